"""E2B's pause, connect (resume), snapshots and auto-pause through its SDK, sync and
async, against bud with a state directory. Prints what it saw as one JSON object
(asserted by server/tests/durable.rs)."""

import asyncio
import json
import time

from e2b import SandboxQuery, SandboxState
from e2b_code_interpreter import AsyncSandbox, Sandbox

seen = {}
sbx = Sandbox.create(template="base", timeout=120, metadata={"who": "durable"})
sbx.run_code("x = 41")
sbx.files.write("kept.txt", "kept")

seen["pause"] = sbx.pause()
seen["pause_again"] = sbx.pause()
seen["state"] = str(Sandbox.get_info(sbx.sandbox_id).state.value)
paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
seen["listed"] = [
    sbx.sandbox_id in [s.sandbox_id for s in paused],
    sbx.sandbox_id in [s.sandbox_id for s in running],
]
seen["while_paused"] = []
for call in (lambda: sbx.files.read("kept.txt"), lambda: sbx.run_code("print(x)")):
    try:
        call()
        seen["while_paused"].append("ran")
    except Exception as e:  # the SDK's own exception for a sandbox that is not running
        seen["while_paused"].append(type(e).__name__)

resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
seen["resumed"] = [
    resumed.run_code("print(x + 1)").logs.stdout,
    resumed.files.read("kept.txt"),
    str(Sandbox.get_info(sbx.sandbox_id).state.value),
]

snap = resumed.create_snapshot()
a = Sandbox.create(template=snap.snapshot_id, timeout=60)
b = Sandbox.create(template=snap.snapshot_id, timeout=60)
probe = "import os; print(x, os.urandom(8).hex())"
out_a, out_b = a.run_code(probe).logs.stdout, b.run_code(probe).logs.stdout
seen["from_snapshot"] = [out_a[0].split()[0], out_b[0].split()[0], out_a != out_b]
seen["snapshots_listed"] = snap.snapshot_id in [
    s.snapshot_id for s in Sandbox.list_snapshots().next_items()
]
seen["snapshot_deleted"] = [
    Sandbox.delete_snapshot(snap.snapshot_id),
    Sandbox.delete_snapshot(snap.snapshot_id),
]

auto = Sandbox.create(template="base", timeout=2, lifecycle={"on_timeout": "pause"})
auto.run_code("y = 'paused at its timeout'")
deadline = time.time() + 60
while time.time() < deadline and Sandbox.get_info(auto.sandbox_id).state != SandboxState.PAUSED:
    time.sleep(0.3)
seen["auto_paused"] = str(Sandbox.get_info(auto.sandbox_id).state.value)
seen["auto_resumed"] = Sandbox.connect(auto.sandbox_id, timeout=60).run_code("print(y)").logs.stdout

# autoResume: any in-sandbox call resumes a paused sandbox, no connect needed.
awake = Sandbox.create(
    template="base", timeout=60, lifecycle={"on_timeout": "pause", "auto_resume": True}
)
awake.run_code("w = 'woken by a call'")
awake.pause()
seen["auto_resume"] = [
    str(Sandbox.get_info(awake.sandbox_id).state.value),
    awake.run_code("print(w)").logs.stdout,
    str(Sandbox.get_info(awake.sandbox_id).state.value),
]


async def main():
    s = await AsyncSandbox.create(template="base", timeout=60)
    await s.run_code("z = 'async'")
    p = await s.pause()
    back = await AsyncSandbox.connect(s.sandbox_id, timeout=60)
    out = (await back.run_code("print(z)")).logs.stdout
    await back.kill()
    return [p, out]


seen["async"] = asyncio.run(main())
for s in (resumed, a, b, awake):
    s.kill()
Sandbox.kill(auto.sandbox_id)
print(json.dumps(seen))
