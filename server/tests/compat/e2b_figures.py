"""The unmodified E2B code-interpreter SDK against bud on its default template
(`code-interpreter-v1`, bud's `datascience`; E2B_API_URL / E2B_SANDBOX_URL point at bud): a
matplotlib figure, DataFrames (with their data), charts, display() of frames and figures,
the template's warm kernel in a sandbox's first code context, and a frame through the async
SDK. What needs numpy, pandas or matplotlib; the rest of the code interpreter runs on the
`python` template (e2b_interpreter.py). Prints what it saw as one JSON object; the Rust
test (server/tests/compat_figures.rs) asserts every value."""

import asyncio
import base64
import json
import os
import sys
import time

from e2b_code_interpreter import AsyncSandbox, Sandbox

seen = {}
timings = {}
sbx = Sandbox.create(timeout=1800)

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

# A DataFrame's columns as E2B's `data`: timestamps in ISO 8601, NaN as null, index left out.
started = time.perf_counter()
e = sbx.run_code(
    "import numpy as np\n"
    "df = pd.DataFrame({'n': [1, 2], 'x': [0.5, np.nan], 's': ['p', 'q'],\n"
    "                   't': pd.to_datetime(['2024-01-01', '2024-01-02 03:04:05'])},\n"
    "                  index=['i', 'j'])\n"
    "df"
)
timings["frame"] = time.perf_counter() - started
r = e.results[0]
seen["frame_data"] = [len(e.results), r.is_main_result, r.data, sorted(r.formats())]
seen["frame_columns"] = list(r.data)
started = time.perf_counter()
e = sbx.run_code("big = pd.DataFrame({'v': range(10000)}, dtype=float)\nbig")
timings["frame_10000_rows"] = time.perf_counter() - started
seen["big_frame"] = [len(e.results[0].data["v"]), e.results[0].data["v"][-1]]

# Figures as E2B's charts, each beside its PNG: line, bar, scatter, and one left open,
# which comes after the value (as Jupyter flushes open figures after the cell).
started = time.perf_counter()
e = sbx.run_code("z = 1")
timings["plain_cell"] = time.perf_counter() - started
started = time.perf_counter()
e = sbx.run_code(
    "plt.plot([1, 2, 3], [1, 4, 9], label='squares')\n"
    "plt.plot([1, 2, 3], [2, 3, 4])\n"
    "plt.title('growth')\nplt.xlabel('time (s)')\nplt.ylabel('size [m]')\nplt.show()\n"
    "plt.bar(['a', 'b', 'c'], [3, 1, 2], label='counts')\nplt.title('bars')\nplt.show()\n"
    "plt.scatter([1, 2], [5, 6], label='dots')\nplt.show()\n"
    "fig, ax = plt.subplots()\nax.barh(['p', 'q'], [7, 8])\nax.set_xlabel('amount (kg)')\n"
    "'value'"
)
timings["four_charts"] = time.perf_counter() - started
charts = []
for r in e.results:
    c = r.chart
    row = [r.is_main_result, r.text, r.png is not None]
    if c is not None:
        row += [type(c).__name__, c.type.value, c.title, c.to_dict().get("x_label"),
                c.to_dict().get("y_label"), c.to_dict().get("x_unit"), c.to_dict().get("y_unit")]
        if c.type.value in ("line", "scatter"):
            row.append([[p.label, [list(xy) for xy in p.points]] for p in c.elements])
            row.append([c.x_scale.value, c.x_ticks[:2], c.x_tick_labels[:2]])
        else:
            row.append([[b.label, b.group, b.value] for b in c.elements])
    charts.append(row)
seen["charts"] = charts

# display(): extra results (not the main one), in call order, before the value.
e = sbx.run_code(
    "display('shown')\nprint('printed')\ndisplay(df[['n']], {'k': 1}, exclude=['application/json'])\n"
    "plt.plot([1, 2])\nplt.show()\n"
    "display({'k': [1, 2]})\n40 + 2"
)
seen["display"] = [
    [r.is_main_result, r.text, sorted(r.formats())] for r in e.results
] + [e.logs.stdout, e.results[1].data]

# The first context's kernel is the one the template holds (older than a command started
# now), with the template's modules imported; the next one's is new.
sbx.files.make_dir("proj")
ctx = sbx.create_code_context(cwd="/home/user/proj")
shell_pid = int(sbx.commands.run("echo $$").stdout)
started = time.perf_counter()
sbx.run_code("x = 'in the context'", context=ctx)
timings["context_first_cell"] = time.perf_counter() - started
PID = "import os, sys\n[os.getpid(), 'pandas' in sys.modules]"
kernel = sbx.run_code(PID, context=ctx).results[0].json
seen["kernel"] = [kernel[0] < shell_pid, kernel[1]]
other = sbx.create_code_context()
started = time.perf_counter()
fresh = sbx.run_code(PID, context=other).results[0].json
timings["context_fresh_kernel_first_cell"] = time.perf_counter() - started
seen["fresh_kernel"] = [fresh[0] > shell_pid, fresh[1]]
sbx.remove_code_context(other)
sbx.remove_code_context(ctx)
sbx.kill()


async def async_part():
    """A DataFrame's rich result through the async SDK."""
    a = await AsyncSandbox.create(timeout=1800)
    frame = await a.run_code("import pandas as pd\npd.DataFrame({'n': [1, 2]})")
    seen["async_frame"] = frame.results[0].data
    await a.kill()


asyncio.run(async_part())
seen["timings"] = {k: round(v, 3) for k, v in timings.items()}
print(json.dumps(seen))
# Everything the test reads is printed: leave without the interpreter's teardown (see
# e2b_interpreter.py).
sys.stdout.flush()
os._exit(0)
