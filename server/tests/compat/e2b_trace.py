"""What an E2B sandbox leaves in its trace: E2B's SDK runs a cell, a command that fails, writes
a file and kills the sandbox; bud's own routes then read the trace (the sandbox id is the
session id). Prints the sandbox id as one JSON object (server/tests/compat.rs reads the
trace itself)."""

import json

from e2b import CommandExitException
from e2b_code_interpreter import Sandbox

sbx = Sandbox.create(template="base", timeout=300)
seen = {"id": sbx.sandbox_id}
seen["cell"] = sbx.run_code("print(6 * 7)").logs.stdout
try:
    sbx.commands.run("echo traced; exit 4")
    seen["cmd"] = "no exception"
except CommandExitException as e:
    seen["cmd"] = e.exit_code
sbx.files.write("/home/user/evidence.txt", "kept")
seen["killed"] = sbx.kill()
print(json.dumps(seen))
