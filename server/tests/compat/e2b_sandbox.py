"""The E2B SDK's files and commands against bud: write/read, list, make_dir, rename, remove,
exists, commands with output, exit codes, env and cwd, a code context, a timeout change. Prints what it saw
as one JSON object (asserted by server/tests/compat.rs)."""

import json

import httpx

from e2b import CommandExitException, NotFoundException
from e2b_code_interpreter import Sandbox

seen = {}
sbx = Sandbox.create(template="base", timeout=1800, envs={"GREETING": "hello"})

info = sbx.files.write("/home/user/data.txt", "one\ntwo\n")
seen["written"] = [info.name, info.path]
seen["read"] = sbx.files.read("/home/user/data.txt")
seen["read_relative"] = sbx.files.read("data.txt")
seen["bytes"] = list(sbx.files.read("data.txt", format="bytes")[:3])
seen["seen_by_code"] = sbx.run_code("open('/home/user/data.txt').read().split()").text

r = sbx.commands.run("echo out; echo err >&2; echo $GREETING")
seen["cmd"] = [r.stdout, r.stderr, r.exit_code]
try:
    sbx.commands.run("echo partial; exit 3")
    seen["cmd_exit"] = "no exception"
except CommandExitException as e:
    seen["cmd_exit"] = [e.exit_code, e.stdout]
chunks = []
sbx.commands.run("wc -l < data.txt", cwd="/home/user", on_stdout=chunks.append,
                 envs={"X": "1"})
seen["cmd_cwd"] = "".join(chunks).strip()
# Commands run as E2B's user unless root is asked for (Authorization: Basic "root:").
seen["users"] = [sbx.commands.run("id -un").stdout, sbx.commands.run("id -un", user="root").stdout]

seen["mkdir"] = [sbx.files.make_dir("/home/user/d/e"), sbx.files.make_dir("/home/user/d/e")]
sbx.files.rename("/home/user/data.txt", "/home/user/d/moved.txt")
seen["moved"] = sbx.files.read("/home/user/d/moved.txt")
seen["exists"] = [sbx.files.exists("/home/user/data.txt"), sbx.files.exists("/home/user/d")]
listing = sbx.files.list("/home/user/d")
seen["list"] = sorted([x.name, x.type.value, x.path, x.size] for x in listing)
seen["list_deep"] = sorted(x.path for x in sbx.files.list("/home/user", depth=2))
sbx.files.remove("/home/user/d")
seen["removed"] = sbx.files.exists("/home/user/d")
sbx.files.write("/home/user/s/target.txt", "t")
sbx.commands.run("ln -s target.txt /home/user/s/link.txt")
sbx.files.write("/home/user/packed.txt", "gzip " * 1000, gzip=True)
seen["gzip_read"] = sbx.files.read("/home/user/packed.txt", gzip=True) == "gzip " * 1000
raw = httpx.get(sbx.download_url("/home/user/packed.txt"), headers={"Accept-Encoding": "gzip"})
seen["gzip_raw"] = [raw.status_code, raw.headers.get("content-encoding"),
                    len(raw.content) == 5000, int(raw.headers["content-length"]) < 200]
seen["symlinks"] = sorted([x.name, x.type.value, x.symlink_target]
                          for x in sbx.files.list("/home/user/s"))
try:
    sbx.files.read("/home/user/nope.txt")
    seen["missing"] = "no exception"
except NotFoundException:
    seen["missing"] = "NotFoundException"

# A code context: its calls carry only the traffic access token (with keys, the one the
# server checks).
ctx = sbx.create_code_context()
in_ctx = sbx.run_code("x = 41\nx + 1", context=ctx).text
listed = [c.id for c in sbx.list_code_contexts()].count(ctx.id)
sbx.remove_code_context(ctx)
seen["context"] = [in_ctx, listed, [c.id for c in sbx.list_code_contexts()].count(ctx.id)]

sbx.set_timeout(60)
seen["connected"] = Sandbox.connect(sbx.sandbox_id).run_code("1 + 1").text
sbx.kill()
print(json.dumps(seen))
