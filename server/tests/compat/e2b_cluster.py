"""E2B's SDK against a bud cluster's front (HAProxy, scripts/cluster.sh): sandboxes made
through the front land on different nodes, every in-sandbox call reaches the sandbox's node
(the E2b-Sandbox-Id header), and the list shows every node's sandboxes (Redis), with
metadata filters. Prints what it saw as one JSON object (asserted by tests/cluster.rs)."""

import json
import time
import uuid

from e2b import SandboxQuery
from e2b_code_interpreter import Sandbox

run = uuid.uuid4().hex[:8]
seen = {"ids": [], "echo": [], "files": [], "cells": []}
boxes = [Sandbox.create(template="base", timeout=1800, metadata={"run": run, "i": str(i)})
         for i in range(4)]
try:
    for i, box in enumerate(boxes):
        seen["ids"].append(box.sandbox_id)
        seen["echo"].append(box.commands.run(f"echo box {i}").stdout)
        box.files.write(f"/home/user/f{i}.txt", f"file {i}")
        seen["files"].append(box.files.read(f"/home/user/f{i}.txt"))
        box.run_code(f"v = {i} * 10")
    # A second round: each sandbox kept its own state on its own node.
    for box in boxes:
        seen["cells"].append(box.run_code("print(v)").logs.stdout)

    def listed(query):
        ids = []
        paginator = Sandbox.list(query=query)
        while paginator.has_next:
            ids.extend(s.sandbox_id for s in paginator.next_items())
        return sorted(ids)

    seen["listed"] = listed(SandboxQuery(metadata={"run": run}))
    seen["listed_one"] = listed(SandboxQuery(metadata={"run": run, "i": "2"}))
finally:
    for box in boxes:
        box.kill()
# Each node publishes its rows within about 100 ms of a change (registry docs).
time.sleep(0.5)
seen["listed_after_kill"] = listed(SandboxQuery(metadata={"run": run}))
print(json.dumps(seen))
