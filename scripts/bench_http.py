"""The HTTP client the benchmark scripts share (Python's stdlib only): one keep-alive
connection to a running `bud serve`, a call timed in milliseconds, and `/metrics` read.
Asserts nothing about time; a call answered with an error status ends the script with it.
"""

import http.client
import json
import sys
import time


class Api:
    def __init__(self, host, port, timeout):
        self.conn = http.client.HTTPConnection(host, port, timeout=timeout)

    def call(self, method, path, body=None):
        """(the JSON answer or None, milliseconds taken); exits on a status past 299 but 204."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data is not None else {}
        started = time.perf_counter()
        self.conn.request(method, path, body=data, headers=headers)
        r = self.conn.getresponse()
        raw = r.read()
        elapsed = (time.perf_counter() - started) * 1e3
        if r.status >= 300 and r.status != 204:
            sys.exit(f"{method} {path}: {r.status} {raw[:300]!r}")
        return (json.loads(raw) if raw else None), elapsed

    def metric(self, name):
        """Metric `name` in `/metrics`, summed over its labels."""
        self.conn.request("GET", "/metrics")
        text = self.conn.getresponse().read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))
