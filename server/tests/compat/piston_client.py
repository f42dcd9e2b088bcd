"""aiopyston (a Piston v2 client, unmodified) against bud: runtimes, python and bash with
stdin and args, a runtime error, an unknown language. Prints what it saw as JSON (asserted by
server/tests/compat.rs). argv[1] is the base URL, argv[2] an API key or ''."""

import asyncio
import json
import sys

from pyston import File, PystonClient
from pyston.exceptions import ExecutionError


async def main(base, key):
    client = PystonClient(api_key=key or None, base_url=base)
    seen = {}
    try:
        runtimes = await client.runtimes()
        seen["runtimes"] = sorted([r.language, r.aliases] for r in runtimes)
        seen["python_version"] = [r.version for r in runtimes if r.language == "python"][0]
        out = await client.execute(
            "python",
            [File("import sys\nprint(sys.argv[1:], sys.stdin.read().upper())", "main.py")],
            stdin="piped",
            args=["a", "b c"],
        )
        seen["python"] = [out.run_stage.stdout, out.run_stage.code, out.langauge]
        out = await client.execute(
            "bash", [File('echo "$1-$2"; read line; echo "got $line"; exit 4')],
            stdin="input\n", args=["x", "y"],
        )
        seen["bash"] = [out.run_stage.stdout, out.run_stage.code]
        out = await client.execute("py", [File("raise ValueError('boom')")])
        # aiopyston reads `stdrr` (sic), so stderr is seen through `output`.
        seen["error"] = [out.run_stage.code, out.run_stage.output.strip().splitlines()[-1]]
        try:
            await client.execute("cobol", [File("DISPLAY 'HI'.")])
            seen["unknown"] = "no exception"
        except ExecutionError as e:
            seen["unknown"] = str(e)
    finally:
        await client.close_session()
    print(json.dumps(seen))


asyncio.run(main(sys.argv[1], sys.argv[2]))
