"""The unmodified E2B code-interpreter SDK and the Piston client aiopyston, running
JavaScript on bud's `node` template (E2B_API_URL / E2B_SANDBOX_URL point at bud; argv[1] is
Piston's base URL): stateful JS cells with run_code(language="js"), logs, the last value, an
error, JS contexts of their own beside Python, TypeScript cells and a TypeScript context
(language="ts"), and Piston `javascript` and `typescript` runs with stdin and args. Prints what it saw as one JSON object; the Rust test (server/tests/compat.rs) asserts
every value."""

import asyncio
import json
import sys

from e2b_code_interpreter import Sandbox
from pyston import File, PystonClient

seen = {}
sbx = Sandbox.create(template="node", timeout=600)
try:
    seen["first"] = sbx.run_code("const x = 41;\nx + 1", language="js").text
    seen["stateful"] = sbx.run_code("x * 2", language="javascript").text
    e = sbx.run_code("console.log('out'); console.error('err'); 'done'", language="js")
    seen["logs"] = [e.logs.stdout, e.logs.stderr, e.text]
    awaited = sbx.run_code("await new Promise((r) => setTimeout(() => r('later'), 10))",
                           language="js")
    seen["awaited"] = awaited.text
    failed = sbx.run_code("null.x", language="js")
    seen["error"] = [failed.error.name, failed.error.value] if failed.error else None
    seen["after_error"] = sbx.run_code("x", language="js").text

    ctx = sbx.create_code_context(language="js")
    seen["context_language"] = ctx.language
    seen["context_isolated"] = sbx.run_code("typeof x", context=ctx).text
    sbx.run_code("const y = 'in context'", context=ctx)
    seen["context_state"] = sbx.run_code("y", context=ctx).text
    seen["default_untouched"] = sbx.run_code("typeof y", language="js").text
    seen["python_beside"] = sbx.run_code("6 * 7").text
    ts = sbx.run_code("interface P { n: number }\nconst p: P = { n: 20 };\np.n * 2 + 2",
                      language="ts")
    seen["typescript"] = [ts.text, ts.error]
    bad = sbx.run_code("let q: = 1", language="typescript")
    seen["typescript_error"] = [bad.error.name, bad.error.value] if bad.error else None
    tctx = sbx.create_code_context(language="ts")
    seen["ts_context_language"] = tctx.language
    sbx.run_code("enum Color { Red, Green }\nconst c: Color = Color.Green", context=tctx)
    seen["ts_context_state"] = sbx.run_code("Color[c]", context=tctx).text
finally:
    sbx.kill()


async def piston(base):
    client = PystonClient(base_url=base)
    runtimes = await client.runtimes()
    js = [r for r in runtimes if r.language == "javascript"]
    seen["piston_runtime"] = [js[0].language, sorted(js[0].aliases), js[0].version[:3]] if js else None
    out = await client.execute(
        "javascript",
        [File("const input = require('fs').readFileSync(0, 'utf8');\n"
              "console.log(process.argv.slice(2).join('|'), input.trim().toUpperCase());\n"
              "process.exitCode = 3", "main.js")],
        stdin="piped in\n",
        args=["a", "b c"],
    )
    seen["piston_run"] = [out.run_stage.stdout, out.run_stage.code]
    ts = await client.execute(
        "typescript",
        [File("const args: string[] = process.argv.slice(2);\nconsole.log(args.length)",
              "main.ts")],
        args=["x", "y"],
    )
    # aiopyston spells the answer's language field `langauge`.
    seen["piston_ts"] = [ts.langauge, ts.run_stage.stdout, ts.run_stage.code]
    await client.close_session()


asyncio.run(piston(sys.argv[1]))
print(json.dumps(seen))
