"""The E2B SDKs (code interpreter, sync and async) against bud: while a cell runs, the same
sandbox's files are read, written and listed, a command runs to its end, a background
command is started and waited for, and a directory watched. Each cell waits for a file
that the client writes only after all that, so nothing here could have waited for the
cell's end. Prints what it saw as one JSON object (asserted by server/tests/beside.rs)."""

import asyncio
import json
import os
import threading
import time

from e2b_code_interpreter import AsyncSandbox, Sandbox

# A cell that says it started, then waits for GO to be written, then prints what it holds.
CELL = (
    "import os, time\n"
    "open('/home/user/{started}', 'w').close()\n"
    "while not (os.path.exists('/home/user/{go}') and os.path.getsize('/home/user/{go}')):\n"
    "    time.sleep(0.02)\n"
    "print('cell saw', open('/home/user/{go}').read())\n"
)

seen = {}
sbx = Sandbox.create(template="base", timeout=1800)
cell = {}


def run_cell():
    e = sbx.run_code(CELL.format(started="started", go="go"), timeout=60)
    cell["stdout"] = e.logs.stdout
    cell["error"] = e.error and e.error.name


t = threading.Thread(target=run_cell)
t.start()
deadline = time.monotonic() + 120
while not sbx.files.exists("/home/user/started"):
    assert time.monotonic() < deadline, "the cell never started"
    time.sleep(0.05)

sbx.files.write("/home/user/notes/a.txt", "written beside a cell")
seen["read"] = sbx.files.read("/home/user/notes/a.txt")
seen["listed"] = sorted(e.name for e in sbx.files.list("/home/user/notes"))
seen["info_owner"] = sbx.files.get_info("/home/user/notes/a.txt").owner
r = sbx.commands.run("echo $((6 * 7)) as $(id -un) in $(pwd)")
seen["command"] = [r.stdout, r.exit_code]
h = sbx.commands.run("sleep 0.2; echo from the background", background=True)
seen["background"] = h.wait().stdout
handle = sbx.files.watch_dir("/home/user/notes")
sbx.files.write("/home/user/notes/b.txt", "x")
events = []
for _ in range(50):
    events += [(e.type.name, e.name) for e in handle.get_new_events()]
    if ("CREATE", "b.txt") in events:
        break
    time.sleep(0.1)
handle.stop()
seen["watched"] = ("CREATE", "b.txt") in events
seen["cell_still_running"] = t.is_alive()
sbx.files.write("/home/user/go", "go")
t.join()
seen["cell"] = cell
sbx.kill()


async def main():
    a = await AsyncSandbox.create(template="base", timeout=1800)
    task = asyncio.create_task(a.run_code(CELL.format(started="s2", go="g2"), timeout=60))
    for _ in range(2400):
        if await a.files.exists("/home/user/s2"):
            break
        await asyncio.sleep(0.05)
    await a.files.write("/home/user/async.txt", "async beside")
    got = await a.files.read("/home/user/async.txt")
    r = await a.commands.run("cat /home/user/async.txt; echo")
    running = not task.done()
    await a.files.write("/home/user/g2", "async go")
    e = await task
    await a.kill()
    return {"read": got, "command": r.stdout, "cell_still_running": running,
            "cell": e.logs.stdout}


seen["async"] = asyncio.run(main())
print(json.dumps(seen), flush=True)
# Out at once, as e2b_processes.py: the SDK's streams left to the interpreter's shutdown
# can abort it (SIGABRT after every result above was printed, seen once in 14 runs here).
os._exit(0)
