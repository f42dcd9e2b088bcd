# Warm-up of the datascience template, run by bud's worker once before the snapshot (after
# importing numpy, pandas and matplotlib with the Agg backend): the code paths a typical data
# job takes run here once, so their code pages, lazily built tables and caches (matplotlib's
# font list, pandas' group-by machinery, numpy's ufunc loops) are in the template.
import builtins
import functools
import io
import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import font_manager


# Fonts in memory. matplotlib 3.6 hands FreeType the font *file*, and FreeType loads every
# glyph it draws with a seek and a read on it: about 700 syscalls per small figure, which
# under kvm_pvm (every guest syscall emulated, ~0.5 ms) made drawing one figure take ~0.4 s
# and saving it another ~0.25 s. matplotlib's ft2font opens the file with the builtin
# `open`; while it makes a font object, that `open` serves the font files from bytes read
# once (kept in the template), so FreeType reads from memory. The font objects keep the
# file's path as their name, which the PDF and PS backends open themselves to embed it.
_real_open = builtins.open
_font_bytes = {}
_uncached_get_font = font_manager._get_font.__wrapped__


def _open_font_in_memory(file, mode="r", *args, **kwargs):
    if mode == "rb" and isinstance(file, str) and file in _font_bytes:
        in_memory = io.BytesIO(_font_bytes[file])
        in_memory.name = file  # what FT2Font.fname reports, as for a real file
        return in_memory
    return _real_open(file, mode, *args, **kwargs)


@functools.lru_cache(64)
def get_font_in_memory(font_filepaths, hinting_factor, *, _kerning_factor, thread_id):
    """font_manager._get_font, with the font files read from memory (same cache key)."""
    for path in font_filepaths:
        if path not in _font_bytes:
            with _real_open(path, "rb") as f:
                _font_bytes[path] = f.read()
    builtins.open = _open_font_in_memory
    try:
        return _uncached_get_font(font_filepaths, hinting_factor,
                                  _kerning_factor=_kerning_factor, thread_id=thread_id)
    finally:
        builtins.open = _real_open


if not getattr(font_manager._get_font, "bud_in_memory", False):
    get_font_in_memory.bud_in_memory = True
    font_manager._get_font = get_font_in_memory
    # As matplotlib does for its own cache: FT2Font objects must not cross a fork.
    os.register_at_fork(after_in_child=get_font_in_memory.cache_clear)

rng = np.random.default_rng(0)
frame = pd.DataFrame({
    "city": ["Oslo", "Lima", "Pune", "Oslo", "Lima", "Pune"] * 50,
    "year": np.repeat(np.arange(2000, 2050), 6),
    "value": rng.normal(size=300),
})
csv = frame.to_csv(index=False)
frame = pd.read_csv(io.StringIO(csv))
summary = frame.groupby("city")["value"].agg(["mean", "sum", "count"]).sort_values("mean")
pivot = frame.pivot_table(index="year", columns="city", values="value", aggfunc="mean")
merged = frame.merge(summary, left_on="city", right_index=True)
described = frame.describe()
text = summary.to_string() + repr(pivot.head()) + described.to_html()[:10] + summary._repr_html_()[:10]
dates = pd.date_range("2024-01-01", periods=30, freq="D")
series = pd.Series(rng.normal(size=30), index=dates).rolling(3).mean().resample("W").sum()
matrix = rng.normal(size=(50, 50))
solved = np.linalg.solve(matrix + 50 * np.eye(50), np.ones(50))
stats = (np.mean(matrix), np.std(matrix), np.percentile(matrix, 90), np.sort(matrix, axis=0))

fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=100)
ax.plot(np.arange(10), np.arange(10) ** 2, label="square", marker="o")
ax.bar(["a", "b", "c"], [3, 1, 2])
ax.scatter(rng.normal(size=20), rng.normal(size=20))
ax.hist(rng.normal(size=100), bins=10)
ax.set_title("warm-up $x^2$")
ax.set_xlabel("x")
ax.legend()
summary["mean"].plot(kind="bar", ax=ax)
fig.tight_layout()
buffer = io.BytesIO()
fig.savefig(buffer, format="png")
plt.close("all")
del frame, summary, pivot, merged, described, text, dates, series, matrix, solved, stats
del fig, ax, buffer, csv, rng
