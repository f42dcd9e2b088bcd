"""E2B's users against bud, sync and async: commands, terminals and files belong to `user`
(uid 1000, home /home/user, the default working directory) unless a call asks for root;
files written as user are user's (a command as user may change an uploaded file), entries
report their true owner, group and permissions. Prints what it saw as one JSON object
(asserted by server/tests/compat.rs)."""

import asyncio
import json
import os
import time

import httpx

from e2b import AsyncSandbox, CommandExitException, PtySize, Sandbox

WHO = 'id -un; id -u; id -g; id -Gn; echo "$HOME $USER $LOGNAME $SHELL"; pwd'
GETCWD = "python3 -c 'import os; print(os.getcwd())'"

seen = {}
sbx = Sandbox.create(template="base", timeout=1800)

# Who runs a command, and where.
seen["default"] = sbx.commands.run(WHO).stdout.splitlines()
seen["getcwd"] = sbx.commands.run(GETCWD).stdout
seen["root"] = sbx.commands.run(WHO, user="root").stdout.splitlines()
seen["explicit_user"] = sbx.commands.run("id -un", user="user").stdout
seen["relative_cwd"] = sbx.commands.run("mkdir -p sub && cd sub && pwd -P").stdout
seen["cwd_sub"] = sbx.commands.run("pwd", cwd="sub").stdout
seen["home"] = sbx.commands.run("stat -c '%U %G %a' /home/user /tmp").stdout.splitlines()
try:
    sbx.commands.run("true", user="nobody")
    seen["unknown_user"] = "no exception"
except Exception as e:  # noqa: BLE001 - the SDK's error for invalid_argument
    seen["unknown_user"] = type(e).__name__

# Files written as user are user's: a command as user appends to an uploaded file.
sbx.files.write("/home/user/up.txt", "uploaded\n")
r = sbx.commands.run("echo appended >> up.txt && cat up.txt")
seen["modified"] = [r.exit_code, sbx.files.read("up.txt")]
info = sbx.files.get_info("/home/user/up.txt")
seen["up_info"] = [info.owner, info.group, info.permissions, oct(info.mode)]
sbx.files.make_dir("/home/user/made/deep")
seen["made"] = [[e.name, e.owner, e.group] for e in sbx.files.list("/home/user/made")]
sbx.files.write("/home/user/new/dir/f.txt", "f")
seen["parents"] = sbx.commands.run("stat -c '%U' new new/dir new/dir/f.txt").stdout.split()

# Written as root: root's; user may read it but not change it; root may.
sbx.files.write("/home/user/rootfile.txt", "r\n", user="root")
root_info = sbx.files.get_info("rootfile.txt")
seen["root_info"] = [root_info.owner, root_info.group, root_info.permissions]
try:
    sbx.commands.run("echo x >> rootfile.txt")
    seen["user_denied"] = "no exception"
except CommandExitException as e:
    seen["user_denied"] = [e.exit_code, "Permission denied" in e.stderr]
seen["root_may"] = sbx.commands.run("echo x >> rootfile.txt; id -un", user="root").stdout
sbx.commands.run("chmod 600 rootfile.txt; mkdir mine; touch mine/f", user="root")
sbx.commands.run("mkdir by-user && touch by-user/f")
listed = {e.name: [e.owner, e.group, e.permissions] for e in sbx.files.list("/home/user")}
seen["listed"] = {k: listed.get(k) for k in ("rootfile.txt", "mine", "by-user", "up.txt")}
seen["made_by_user"] = [[e.name, e.owner] for e in sbx.files.list("/home/user/by-user")]

# Signed and unsigned URLs carry the user too.
upload = sbx.upload_url("/home/user/via-url.txt", user="root")
httpx.post(upload, files={"file": ("via-url.txt", b"u")}).raise_for_status()
seen["url_owner"] = sbx.files.get_info("via-url.txt").owner

# A terminal as user, and as root.
def terminal(user):
    term = sbx.pty.create(size=PtySize(rows=24, cols=80), timeout=0, user=user)
    screen = bytearray()
    sbx.pty.send_stdin(term.pid, b"echo \"I am $(id -un) in $(pwd)\"; exit 7\n")
    try:
        term.wait(on_pty=screen.extend)
    except CommandExitException:
        pass
    text = screen.decode(errors="replace")
    return [s in text for s in (f"I am {user or 'user'} in /home/user",)]

seen["pty"] = terminal(None) + terminal("root")
sbx.kill()


async def async_part():
    a = await AsyncSandbox.create(template="base", timeout=1800)
    who = (await a.commands.run("id -un; pwd")).stdout.split()
    root = (await a.commands.run("id -un; echo $HOME", user="root")).stdout.split()
    await a.files.write("/home/user/a.txt", "a\n")
    info = await a.files.get_info("a.txt")
    changed = await a.commands.run("echo more >> a.txt && wc -l < a.txt")
    await a.files.write("/home/user/r.txt", "r", user="root")
    entries = {e.name: e.owner for e in await a.files.list("/home/user")}
    await a.kill()
    return [who, root, info.owner, changed.stdout.strip(), entries.get("a.txt"),
            entries.get("r.txt")]


seen["async"] = asyncio.run(async_part())
print(json.dumps(seen), flush=True)
# Out at once, as e2b_processes.py does: the SDK's stream finalizers may abort the
# interpreter's shutdown.
os._exit(0)
