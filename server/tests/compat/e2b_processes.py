"""The E2B SDK's process API against bud, sync and async: background commands, list,
connect, stdin (send, stream, close), kill, concurrent commands, a command that outlives
its client's timeout, a terminal (size, typed input, resize), and watched directories
(sync: polled events; async: streamed). Prints what it saw as one JSON object
(asserted by server/tests/processes.rs)."""

import asyncio
import json
import os
import threading
import time

from e2b import (AsyncSandbox, CommandExitException, PtySize, Sandbox, SandboxException,
                 TimeoutException)

seen = {}
sbx = Sandbox.create(template="base", timeout=1800, envs={"GREETING": "hello"})

# A background command: the handle comes back while it runs (it cannot end before the
# file it waits for exists).
CMD = "echo started; while [ ! -e /home/user/go ]; do sleep 0.1; done; echo done; exit 4"
h = sbx.commands.run(CMD, background=True)
seen["pid_is_int"] = isinstance(h.pid, int) and h.pid > 1
listed = [(p.pid, p.cmd, p.args) for p in sbx.commands.list()]
seen["listed"] = [p for p in listed if p[0] == h.pid] == [(h.pid, "/bin/bash", ["-l", "-c", CMD])]
# A foreground command runs while the background one lives.
r = sbx.commands.run("echo $GREETING from the foreground")
seen["foreground_meanwhile"] = [r.stdout, r.exit_code]
sbx.files.write("/home/user/go", "")
try:
    h.wait()
    seen["background_end"] = "no exception"
except CommandExitException as e:
    seen["background_end"] = [e.exit_code, e.stdout]
seen["listed_after_end"] = [p.pid for p in sbx.commands.list() if p.pid == h.pid]

# stdin: send, then close; the command reads to EOF.
cat = sbx.commands.run("while read -r l; do echo \"got $l\"; done; echo eof", background=True,
                       stdin=True)
sbx.commands.send_stdin(cat.pid, "one\n")
cat.send_stdin("two\n")
sbx.commands.stream_input(cat.pid, iter(["three\n", b"four\n"]))
sbx.commands.close_stdin(cat.pid)
seen["stdin"] = cat.wait().stdout

# connect to a running command: output from the moment of connecting.
ticker = sbx.commands.run("i=0; while [ $i -lt 40 ]; do echo tick $i; i=$((i+1)); sleep 0.2; done",
                          background=True, timeout=0)
# Read the start handle's own stream up to tick 2; a connection made after that sees
# only later ticks.
early = ""
for stdout, _, _ in ticker:
    early += stdout or ""
    if "tick 2\n" in early:
        break
again = sbx.commands.connect(ticker.pid)
lines = []
def read_some():
    for stdout, _, _ in again:
        if stdout:
            lines.extend(stdout.split())
        if len(lines) >= 6:
            break
reader = threading.Thread(target=read_some)
reader.start()
reader.join(60)
again.disconnect()
seen["connected_output"] = (len(lines) >= 6 and lines[0] == "tick" and int(lines[1]) >= 3
                            and early.startswith("tick 0\ntick 1\n"))
seen["kill"] = sbx.commands.kill(ticker.pid)
try:
    ticker.wait()
    seen["killed_end"] = "no exception"
except CommandExitException as e:
    seen["killed_end"] = [e.exit_code, e.error]
seen["kill_again"] = sbx.commands.kill(ticker.pid)

# A command longer than its client's timeout: the stream ends, the process goes on.
slow = sbx.commands.run("sleep 3; echo still here > /home/user/slow.txt", background=True,
                        timeout=1)
try:
    slow.wait()
    seen["client_timeout"] = "no exception"
except TimeoutException:
    seen["client_timeout"] = "TimeoutException"
t = time.monotonic()
while not sbx.files.exists("/home/user/slow.txt") and time.monotonic() - t < 60:
    time.sleep(0.5)
seen["outlived_client"] = sbx.files.read("/home/user/slow.txt")

# Concurrent foreground commands from threads: the first waits for what the second does,
# so run one after the other they would never end (each has 60 s).
results = {}
def run(name, cmd):
    try:
        results[name] = sbx.commands.run(cmd, timeout=60).stdout
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        results[name] = repr(e)
waiter = "while [ ! -e /home/user/flag ]; do sleep 0.1; done; echo A saw the flag"
maker = "sleep 1; touch /home/user/flag; echo B made it"
threads = [threading.Thread(target=run, args=("A", waiter)),
           threading.Thread(target=run, args=("B", maker))]
for th in threads:
    th.start()
for th in threads:
    th.join()
seen["concurrent"] = [results["A"], results["B"]]

# A terminal: busybox sh at a prompt, its size, typed input, a resize, exit.
term = sbx.pty.create(size=PtySize(rows=24, cols=80), timeout=0)
screen = bytearray()
def read_screen(until):
    t = time.monotonic()
    for _, _, pty in term:
        if pty:
            screen.extend(pty)
        if until in screen or time.monotonic() - t > 60:
            return
sbx.pty.send_stdin(term.pid, b"stty size; tty\n")
read_screen(b"/dev/pts/")
sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
sbx.pty.send_stdin(term.pid, b"stty size; echo $TERM; exit 3\n")
try:
    term.wait(on_pty=screen.extend)
    seen["pty_end"] = "no exception"
except CommandExitException as e:
    seen["pty_end"] = e.exit_code
text = screen.decode(errors="replace")
seen["pty"] = [s in text for s in ("24 80\r\n", "/dev/pts/", "30 100\r\n", "xterm-256color\r\n")]

# A watched directory (the sync SDK polls for events).
sbx.files.make_dir("/home/user/w/sub")
watch = sbx.files.watch_dir("/home/user/w", recursive=True)
sbx.files.write("/home/user/w/one.txt", "1")
sbx.commands.run("echo 2 > /home/user/w/sub/two.txt; rm /home/user/w/one.txt")
changes = []
t = time.monotonic()
while ("sub/two.txt", "write") not in changes and time.monotonic() - t < 60:
    changes += [(e.name, e.type.value) for e in watch.get_new_events()]
    time.sleep(0.2)
watch.stop()
seen["watch"] = [c in changes for c in (("one.txt", "create"), ("one.txt", "write"),
                                        ("sub/two.txt", "create"), ("sub/two.txt", "write"),
                                        ("one.txt", "remove"))]
try:
    watch.get_new_events()
    seen["watch_stopped"] = "no exception"
except SandboxException as e:
    seen["watch_stopped"] = type(e).__name__

sbx.kill()


async def async_part():
    a = await AsyncSandbox.create(template="base", timeout=1800)
    h = await a.commands.run("read -r x; echo \"async $x\"", background=True, stdin=True)
    await a.commands.send_stdin(h.pid, "hi\n")
    r = await h.wait()
    out = [r.stdout, r.exit_code]
    bg = await a.commands.run("sleep 60", background=True)
    listed = [p.pid for p in await a.commands.list()]
    killed = await a.commands.kill(bg.pid)
    # A watched directory (the async SDK streams its events).
    got = []
    w = await a.files.watch_dir("/home/user", lambda e: got.append((e.name, e.type.value)))
    await a.files.write("/home/user/async.txt", "x")
    t = time.monotonic()
    while ("async.txt", "create") not in got and time.monotonic() - t < 60:
        await asyncio.sleep(0.2)
    await w.stop()
    # A terminal through the async SDK: a command typed, its output on the screen, the
    # shell's exit status; then the control plane: info, a new timeout.
    screen = []
    term = await a.pty.create(PtySize(rows=24, cols=80), on_data=screen.append, timeout=0)
    await a.pty.send_stdin(term.pid, b"echo async-pty; exit 4\n")
    try:
        await term.wait()
        pty_end = "no exception"
    except CommandExitException as e:
        pty_end = e.exit_code
    info = await a.get_info()
    await a.set_timeout(90)
    await a.kill()
    return (out, bg.pid in listed, killed, ("async.txt", "create") in got,
            b"async-pty" in b"".join(screen), pty_end, info.sandbox_id == a.sandbox_id)


seen["async"] = list(asyncio.run(async_part()))
print(json.dumps(seen), flush=True)
# Out at once: the SDK's streams that ended early (a client timeout, a handle read part of
# the way) are left to the interpreter's shutdown, where their finalizers can abort it
# (SIGABRT, seen once in a fresh-clone run after every result above was printed).
os._exit(0)
