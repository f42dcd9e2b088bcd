"""The unmodified E2B code-interpreter SDK against bud (E2B_API_URL / E2B_SANDBOX_URL point
at it): a sandbox, stateful cells, streaming callbacks, an error with its traceback, a
matplotlib figure, a DataFrame, contexts, kill. Prints what it saw as one JSON object; the
Rust test (server/tests/compat.rs) asserts every value."""

import base64
import json

from e2b_code_interpreter import Sandbox

seen = {}
sbx = Sandbox.create()
seen["id_prefix"] = sbx.sandbox_id[:4]

seen["first"] = sbx.run_code("x = 41\nx + 1").text
seen["stateful"] = sbx.run_code("x * 2").text
seen["count"] = sbx.run_code("y = 1").execution_count - sbx.run_code("y = 2").execution_count

streamed = []
e = sbx.run_code(
    "import sys, time\nprint('a')\nsys.stdout.flush()\ntime.sleep(0.2)\n"
    "print('b', file=sys.stderr)\nprint('c')",
    on_stdout=lambda m: streamed.append(["stdout", m.line]),
    on_stderr=lambda m: streamed.append(["stderr", m.line]),
)
seen["streamed"] = sorted(streamed)
seen["logs"] = [e.logs.stdout, e.logs.stderr]
seen["no_error"] = e.error is None

rich = sbx.run_code(
    "class Rich:\n"
    "    def _repr_markdown_(self): return '**bold**'\n"
    "    def _repr_svg_(self): return '<svg/>'\n"
    "    def _repr_latex_(self): return r'$x^2$'\n"
    "    def _repr_json_(self): return {'a': [1, 2]}\n"
    "    def _repr_javascript_(self): return 'alert(1)'\n"
    "    def _repr_html_(self): return ('<b>b</b>', {'isolated': True})\n"
    "Rich()"
).results[0]
seen["rich"] = [rich.markdown, rich.svg, rich.latex, rich.json, rich.javascript, rich.html,
                rich.is_main_result]

errors = []
e = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=lambda err: errors.append(err.name))
seen["error"] = [e.error.name, e.error.value, errors]
seen["traceback_has_line"] = "return 1 / 0" in e.error.traceback
seen["traceback_ends"] = e.error.traceback.rstrip().splitlines()[-1]
seen["stderr_after_error"] = e.logs.stderr

e = sbx.run_code(
    "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('bud')\nplt.show()\n'done'"
)
png = base64.b64decode(e.results[0].png)
seen["figure"] = [
    len(e.results), png[:8] == b"\x89PNG\r\n\x1a\n", e.results[0].is_main_result,
    e.results[1].text, e.results[1].is_main_result,
]

e = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
seen["frame"] = ["<table" in e.results[0].html, e.results[0].text.split()]

ctx = sbx.create_code_context()
sbx.run_code("x = 'in the context'", context=ctx)
seen["context"] = [sbx.run_code("x", context=ctx).text, sbx.run_code("x").text]
seen["contexts"] = sorted(c.id == ctx.id for c in sbx.list_code_contexts())
sbx.restart_code_context(ctx)
seen["restarted"] = sbx.run_code("x", context=ctx).error.name
sbx.remove_code_context(ctx)
seen["removed"] = [c.id for c in sbx.list_code_contexts()]

seen["bash"] = sbx.run_code("echo $((6 * 7))", language="bash").logs.stdout
seen["running"] = sbx.is_running()
sbx.kill()
seen["running_after_kill"] = sbx.is_running()
seen["kill_again"] = Sandbox.kill(sbx.sandbox_id)
print(json.dumps(seen))
