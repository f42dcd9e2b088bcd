"""E2B's network settings through its SDK against bud (server/tests/network.rs): a sandbox
created with `network` reaches the name its allow list names and nothing else,
`get_info` shows it, `update_network` replaces it live, `allow_internet_access=False` cuts it off, and
what bud does not do (`rules`) is refused at create. The one host reached is the test's echo
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

try:
    Sandbox.create(template="base", timeout=600,
                   network={"rules": {"echo.test": [{"transform": {"headers": {"X-Key": "k"}}}]}})
    seen["rules"] = "created"
except Exception as e:
    seen["rules"] = [type(e).__name__, "network.rules" in str(e)]

print(json.dumps(seen))
