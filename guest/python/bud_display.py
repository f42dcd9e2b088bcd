"""What E2B's code interpreter adds to a displayed DataFrame or matplotlib figure, guest side:
the frame's columns as JSON (E2B's ``data``) and the chart a figure draws (E2B's ``chart``).

Only :mod:`bud_session` calls these, and only for an object of a library the cell already
imported (it checks ``sys.modules``), so this module imports neither pandas nor matplotlib
at its top: the minimal template, which has neither, never loads them.

The JSON shapes are those E2B's clients read (``e2b_code_interpreter.charts``):

- ``data``: ``{column: [value, ...]}`` (``DataFrame.to_dict(orient="list")``, the index
  left out); timestamps and dates in ISO 8601, numpy scalars as plain numbers, NaN and
  infinities as ``null`` (JSON has neither), anything else as its ``str``.
- ``chart``: ``{"type", "title", "elements", ...}`` with ``type`` one of ``line``,
  ``scatter``, ``bar``, ``pie``, ``box_and_whisker``, ``superchart`` (a figure of several
  axes: one chart per axes in ``elements``) or ``unknown``. 2-D charts add ``x_label``,
  ``y_label``, ``x_unit``, ``y_unit`` (a unit is what a label has in ``(...)`` or
  ``[...]``); line and scatter charts add ``x_ticks``, ``x_tick_labels``, ``x_scale`` and the
  same for y, and their elements are ``{"label", "points": [[x, y], ...]}``; bar elements
  are ``{"label", "group", "value"}``, pie elements ``{"label", "angle", "radius"}``, box
  elements ``{"label", "min", "first_quartile", "median", "third_quartile", "max",
  "outliers"}``.
"""

import datetime
import math
import re
import sys

# A DataFrame with more cells than this gets no ``data`` (its JSON would not fit in the
# display area anyway: ``bud_session._DISPLAY_ROOM``, 2 MiB, for everything a cell shows).
DATA_CELLS = 100_000

# A unit in an axis label: "time (s)" or "speed [m/s]".
_UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")


def plain(value):
    """``value`` as a JSON value: bool, int, finite float, str or None."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.datetime64):
            return None if numpy.isnat(value) else str(value.astype("datetime64[s]"))
        if isinstance(value, numpy.generic):
            return plain(value.item())
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        try:
            return value.isoformat()
        except ValueError:  # pandas' NaT
            return None
    pandas = sys.modules.get("pandas")
    if pandas is not None and value is pandas.NaT:
        return None
    return str(value)


def frame_data(frame):
    """A DataFrame's columns as E2B's ``data``; None if it is larger than DATA_CELLS."""
    if frame.size > DATA_CELLS:
        return None
    return {str(name): [plain(v) for v in column.tolist()] for name, column in frame.items()}


def _point(value):
    """A point's coordinate as E2B gives it: a date in ISO 8601, a number as a float."""
    value = plain(value)
    if isinstance(value, (bool, int)):
        return float(value)
    return value


def _text_or_none(text):
    return text if text else None


def _unit(label):
    match = _UNIT.search(label) if label else None
    return (match.group(1) or match.group(2)) if match else None


def _labels(ax, swap=False):
    """The 2-D fields of an axes' chart; ``swap``: x and y exchanged (horizontal bars and
    boxes, whose value axis is x: E2B's charts always have the values on y)."""
    x, y = _text_or_none(ax.get_xlabel()), _text_or_none(ax.get_ylabel())
    if swap:
        x, y = y, x
    return {"x_label": x, "y_label": y, "x_unit": _unit(x), "y_unit": _unit(y)}


def _converter(axis):
    get = getattr(axis, "get_converter", None)  # matplotlib >= 3.10
    return get() if get is not None else getattr(axis, "converter", None)


def _is_date_axis(axis):
    from matplotlib import dates

    kinds = tuple(getattr(dates, name) for name in
                  ("DateConverter", "ConciseDateConverter", "_SwitchableDateConverter")
                  if hasattr(dates, name))
    return isinstance(_converter(axis), kinds)


def _axis_fields(ax, name):
    """``{name}_ticks``, ``{name}_tick_labels`` and ``{name}_scale`` of axis ``name``."""
    from matplotlib import dates

    axis = getattr(ax, name + "axis")
    labels = [t.get_text() for t in axis.get_ticklabels()]
    ticks = list(axis.get_ticklocs())
    if _is_date_axis(axis):
        ticks = [dates.num2date(t).isoformat() for t in ticks]
        scale = "datetime"
    else:
        ticks = [_point(t) for t in ticks]
        scale = axis.get_scale()
        # Positions 0, 1, 2... labelled otherwise than with those numbers: categories.
        if scale == "linear" and all(
            isinstance(t, float) and t == i and label != str(i)
            for i, (t, label) in enumerate(zip(ticks, labels))
        ):
            scale = "categorical"
    return {f"{name}_ticks": ticks, f"{name}_tick_labels": labels, f"{name}_scale": scale}


def _is_grid_line(line):
    x, y = line.get_xdata(), line.get_ydata()
    return len(x) == 2 and len(y) == 2 and (x[0] == x[1] or y[0] == y[1])


def _artists(ax):
    """What was drawn on ``ax`` (not its axis, spines or title): texts left out."""
    from matplotlib.text import Text

    children = getattr(ax, "_children", None)
    if children is None:  # matplotlib < 3.5
        children = [*ax.lines, *ax.patches, *ax.collections, *ax.images, *ax.texts]
    return [a for a in children if not isinstance(a, Text)]


def _kind(ax):
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import PathPatch, Rectangle, Wedge

    drawn = _artists(ax)
    if all(isinstance(a, Line2D) for a in drawn):
        return "line"
    if all(isinstance(a, (Line2D, PathPatch)) for a in drawn):
        return "box_and_whisker"
    drawn = [a for a in drawn if not (isinstance(a, Line2D) and _is_grid_line(a))]
    for kind, classes in (("scatter", PathCollection), ("pie", Wedge), ("bar", Rectangle)):
        if all(isinstance(a, classes) for a in drawn):
            return kind
    return "unknown"


def _numbered(label, prefix, name):
    """matplotlib's placeholder label ``_child3`` as ``Line 3`` (E2B's naming)."""
    if label.startswith(prefix) and label[len(prefix):].isdigit():
        return f"{name} {int(label[len(prefix):])}"
    return label


def _line(ax, chart):
    chart.update(_labels(ax), **_axis_fields(ax, "x"), **_axis_fields(ax, "y"))
    for line in ax.get_lines():
        if _is_grid_line(line):
            continue
        points = [[_point(x), _point(y)] for x, y in zip(line.get_xdata(), line.get_ydata())]
        chart["elements"].append({"label": _numbered(line.get_label(), "_child", "Line"),
                                  "points": points})


def _scatter(ax, chart):
    chart.update(_labels(ax), **_axis_fields(ax, "x"), **_axis_fields(ax, "y"))
    for collection in ax.collections:
        points = [[_point(x), _point(y)] for x, y in collection.get_offsets()]
        chart["elements"].append({"label": collection.get_label(), "points": points})


def _tick_label_at(axis, position):
    """What names a bar or box centred at ``position`` on ``axis``: on an axis of fixed
    ticks (categories, or ticks set one by one) the label of the nearest tick, else the
    position itself."""
    from matplotlib.category import StrCategoryLocator
    from matplotlib.ticker import FixedLocator

    if isinstance(axis.get_major_locator(), (FixedLocator, StrCategoryLocator)):
        ticks = [(abs(t - position), x.get_text())
                 for t, x in zip(axis.get_ticklocs(), axis.get_ticklabels())]
        if ticks:
            return min(ticks)[1]
    return f"{position:g}"


def _bar(ax, chart):
    horizontal = False
    for container in ax.containers:
        if not hasattr(container, "patches"):
            continue
        orientation = getattr(container, "orientation", None)
        if orientation is None:  # matplotlib < 3.4: E2B's guess, equal heights
            heights = [r.get_height() for r in container.patches]
            orientation = "horizontal" if len(set(heights)) == 1 else "vertical"
        horizontal = orientation == "horizontal"
        group = _numbered(container.get_label() or "", "_container", "Group")
        for rect in container.patches:
            if horizontal:
                where = _tick_label_at(ax.yaxis, rect.get_y() + rect.get_height() / 2)
                value = rect.get_width()
            else:
                where = _tick_label_at(ax.xaxis, rect.get_x() + rect.get_width() / 2)
                value = rect.get_height()
            chart["elements"].append({"label": where, "group": group,
                                      "value": _point(value)})
    chart.update(_labels(ax, swap=horizontal))


def _significant(value, digits=8):
    return float(f"{value:.{digits}g}")


def _pie(ax, chart):
    for wedge in ax.patches:
        chart["elements"].append({
            "label": wedge.get_label(),
            "angle": _significant(abs(wedge.theta2 - wedge.theta1)),
            "radius": float(wedge.r),
        })


def _box(ax, chart):
    """Boxes drawn with ``boxplot(patch_artist=True)``: each box patch gives the quartiles;
    the lines inside it (median), touching it (whiskers) and beyond it (fliers) the rest."""
    from matplotlib.patches import PathPatch

    boxes = []
    for patch in ax.patches:
        if not isinstance(patch, PathPatch):
            continue
        v = patch.get_path().vertices
        boxes.append([float(v[:, 0].min()), float(v[:, 0].max()),
                      float(v[:, 1].min()), float(v[:, 1].max())])
    if not boxes:
        chart.update(_labels(ax))
        return
    # Vertical boxes share their position's width (x); horizontal ones their height (y).
    vertical = len({round(b[1] - b[0], 9) for b in boxes}) == 1
    chart.update(_labels(ax, swap=not vertical))
    axis = ax.xaxis if vertical else ax.yaxis
    found = []
    for lo_pos, hi_pos, lo, hi in boxes if vertical else [[b[2], b[3], b[0], b[1]] for b in boxes]:
        found.append({"label": _tick_label_at(axis, (lo_pos + hi_pos) / 2), "lo_pos": lo_pos,
                      "hi_pos": hi_pos, "min": lo, "first_quartile": lo, "median": None,
                      "third_quartile": hi, "max": hi, "outliers": []})
    for line in ax.get_lines():
        pos, val = line.get_xdata(), line.get_ydata()
        if not vertical:
            pos, val = val, pos
        pos = [float(p) for p in pos]
        val = [float(p) for p in val]
        if not pos:
            continue
        box = next((b for b in found
                    if all(b["lo_pos"] - 1e-9 <= p <= b["hi_pos"] + 1e-9 for p in pos)), None)
        if box is None:
            continue
        if len(val) == 2 and val[0] == val[1] and pos[0] != pos[1]:
            if box["first_quartile"] <= val[0] <= box["third_quartile"] and box["median"] is None:
                box["median"] = val[0]  # the median line across the box (caps are outside)
            continue
        if len(val) == 2 and pos[0] == pos[1]:  # a whisker, from the box outwards
            if min(val) >= box["third_quartile"]:
                box["max"] = max(val)
            elif max(val) <= box["first_quartile"]:
                box["min"] = min(val)
            continue
        if line.get_linestyle() in ("None", "none", " ", ""):
            box["outliers"].extend(val)  # fliers: markers only
    for b in found:
        del b["lo_pos"], b["hi_pos"]
        if b["median"] is None:
            b["median"] = (b["first_quartile"] + b["third_quartile"]) / 2
    chart["elements"] = found


def axes_chart(ax):
    """The chart one axes draws."""
    kind = _kind(ax)
    chart = {"type": kind, "title": _text_or_none(ax.get_title()), "elements": []}
    {"line": _line, "scatter": _scatter, "bar": _bar, "pie": _pie,
     "box_and_whisker": _box}.get(kind, lambda ax, chart: None)(ax, chart)
    return chart


def figure_chart(figure):
    """The chart a rendered figure draws (its tick labels are set by then), or None for a
    figure without data."""
    axes = figure.get_axes()
    if not any(ax.has_data() for ax in axes):
        return None
    if len(axes) == 1:
        return axes_chart(axes[0])
    title = figure._suptitle.get_text() if getattr(figure, "_suptitle", None) else ""
    return {"type": "superchart", "title": title, "elements": [axes_chart(ax) for ax in axes]}
