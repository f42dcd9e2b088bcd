# Warm-up of the datascience template, run by bud's worker once before the snapshot (after
# importing numpy, pandas and matplotlib with the Agg backend): the code paths a typical data
# job takes run here once, so their code pages, lazily built tables and caches (matplotlib's
# font list, pandas' group-by machinery, numpy's ufunc loops) are in the template.
import io

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

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
