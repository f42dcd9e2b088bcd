"""The E2B SDK's file metadata (envd 0.6.2) and watch events with their entries (envd
0.6.3) against bud, sync and async: metadata set by an upload, read back by get_info, list
and rename, replaced and cleared by the next upload, set inside the sandbox by code and
seen by the SDK; bad keys refused with the server's 400; watch events that carry the entry
(create, write, chmod) and events that do not (remove). Prints what it saw as one JSON
object (asserted by server/tests/processes.rs)."""

import asyncio
import json
import os
import time

from e2b import AsyncSandbox, InvalidArgumentException, Sandbox

seen = {}
sbx = Sandbox.create(template="base", timeout=1800)

info = sbx.files.write("/home/user/m.txt", "hello", metadata={"Author": "ada", "purpose": "test"})
seen["written"] = info.metadata
seen["get_info"] = sbx.files.get_info("/home/user/m.txt").metadata
seen["listed"] = [(e.name, e.metadata) for e in sbx.files.list("/home/user") if e.name == "m.txt"]
seen["in_guest"] = sbx.commands.run(
    "python3 -c \"import os; print(sorted(os.listxattr('/home/user/m.txt')),"
    " os.getxattr('/tmp/m.txt', 'user.e2b.author').decode())\"").stdout.strip()
# The next upload replaces the set; one without metadata clears it.
sbx.files.write("/home/user/m.txt", "again", metadata={"purpose": "second"})
seen["replaced"] = sbx.files.get_info("/home/user/m.txt").metadata
moved = sbx.files.rename("/home/user/m.txt", "/home/user/moved.txt")
seen["moved"] = moved.metadata
sbx.files.write("/home/user/moved.txt", "plain")
seen["cleared"] = sbx.files.get_info("/home/user/moved.txt").metadata
# Set by code in the sandbox (not through an upload): the SDK sees it too.
sbx.commands.run("python3 -c \"import os; os.setxattr('/home/user/moved.txt',"
                 " 'user.e2b.by', b'code'); os.setxattr('/home/user/moved.txt',"
                 " 'user.other', b'hidden')\"")
seen["set_in_guest"] = sbx.files.get_info("/home/user/moved.txt").metadata
# A key the SDK lets through but envd refuses (over 246 bytes): the server's 400.
try:
    sbx.files.write("/home/user/bad.txt", "x", metadata={"k" * 300: "v"})
    seen["long_key"] = "no exception"
except InvalidArgumentException as e:
    seen["long_key"] = type(e).__name__
seen["bad_not_written"] = sbx.files.exists("/home/user/bad.txt")

# Watch events with entries (the sync SDK polls).
sbx.files.make_dir("/home/user/w")
watch = sbx.files.watch_dir("/home/user/w", include_entry=True, allow_network_mounts=True)
sbx.files.write("/home/user/w/e.txt", "12345", metadata={"tag": "watched"})
events = []


def take_until(done):
    t = time.monotonic()
    while not any(done(e) for e in events) and time.monotonic() - t < 60:
        events.extend(watch.get_new_events())
        time.sleep(0.2)


def chmodded(e):
    return e.type.value == "chmod" and e.entry is not None and e.entry.permissions == "-rw-------"


# Every event of the upload and the chmod is read while the file is there (the chmod's
# once the upload is over: owner and metadata final); the remove's carries no entry.
sbx.commands.run("chmod 600 /home/user/w/e.txt")
take_until(chmodded)
sbx.commands.run("rm /home/user/w/e.txt")
take_until(lambda e: e.type.value == "remove")
watch.stop()
seen["watch"] = sorted({(e.name, e.type.value, e.entry is not None and e.entry.name,
                         e.entry is not None and e.entry.path) for e in events})
chmod = [e.entry for e in events if chmodded(e)][:1]
seen["chmod_entry"] = [[c.owner, c.size, c.type.value, c.metadata] for c in chmod]
sbx.kill()


async def async_part():
    a = await AsyncSandbox.create(template="base", timeout=1800)
    info = await a.files.write("/home/user/a.txt", "x", metadata={"k": "v"})
    got = []
    w = await a.files.watch_dir("/home/user", got.append, include_entry=True)
    await a.files.write("/home/user/b.txt", "yz", metadata={"side": "async"})
    t = time.monotonic()
    while not any(e.name == "b.txt" and e.entry for e in got) and time.monotonic() - t < 60:
        await asyncio.sleep(0.2)
    await w.stop()
    entries = [(e.entry.size, e.entry.metadata) for e in got if e.name == "b.txt" and e.entry]
    stat = await a.files.get_info("/home/user/a.txt")
    await a.kill()
    return info.metadata, stat.metadata, entries[-1] if entries else None


seen["async"] = list(asyncio.run(async_part()))
print(json.dumps(seen), flush=True)
# Out at once, as the other SDK scripts do (stream finalizers at shutdown).
os._exit(0)
