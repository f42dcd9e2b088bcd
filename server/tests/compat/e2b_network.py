"""E2B's network settings through its SDK against bud (server/tests/network.rs): a sandbox
created with `network` reaches the name its allow list names and nothing else,
`get_info` shows it, `update_network` replaces it live, `allow_internet_access=False` cuts it off, and
`rules` set a header on the sandbox's HTTP requests outside it (the echo server sends the
request back as it got it). The one host reached is the test's echo
server (argv[1]: its port), named echo.test by the server's --egress-hosts. Prints what it
saw as one JSON object."""

import json
import sys

from e2b_code_interpreter import Sandbox

port = int(sys.argv[1])
probe = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=40)
    s.sendall(b'through bud')
    print(s.recv(100).decode())
except Exception as e:
    print(type(e).__name__)
"""
seen = {}


def reach(sbx, host):
    sbx.files.write("/home/user/probe.py", probe)
    return sbx.commands.run(f"python3 /home/user/probe.py {host} {port}", timeout=120).stdout


listed = Sandbox.create(template="base", timeout=600,
                        network={"allow_out": ["echo.test"], "deny_out": ["0.0.0.0/0"]})
seen["allowed"] = reach(listed, "echo.test")
seen["unlisted"] = reach(listed, "other.test")
info = Sandbox.get_info(listed.sandbox_id)
seen["info"] = info.network
listed.update_network({"deny_out": ["0.0.0.0/0"]})
seen["after_update"] = reach(listed, "echo.test")
listed.kill()

cut = Sandbox.create(template="base", timeout=600, allow_internet_access=False)
seen["no_internet"] = reach(cut, "echo.test")
cut.kill()

http_probe = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=40)
s.sendall(b'GET / HTTP/1.1\\r\\nHost: ' + sys.argv[1].encode() + b'\\r\\nX-Key: guest\\r\\n\\r\\n')
got = b''
while b'\\r\\n\\r\\n' not in got:
    got += s.recv(1000)
print(got.decode().split('\\r\\n')[2])
"""
ruled = Sandbox.create(template="base", timeout=600,
                       network={"allow_out": ["echo.test"], "deny_out": ["0.0.0.0/0"],
                                "rules": {"echo.test": [{"transform": {"headers": {"X-Key": "from-e2b"}}}]}})
ruled.files.write("/home/user/http_probe.py", http_probe)
seen["rules"] = ruled.commands.run(f"python3 /home/user/http_probe.py echo.test {port}",
                                   timeout=120).stdout
ruled.kill()

print(json.dumps(seen))
