"""The latency heatmap's renderers: PNG (matplotlib), a self-contained HTML page, JSON.

Each takes the dict `inferlb.otel.heatmap.HeatmapAggregator.grid` returns (or that dict read back from JSON) and
shows two grids: P95 time to first token per endpoint x time, and request counts per TTFT bucket x time. All three
check the grid's shape first and raise ``ValueError`` saying what is wrong with it. They are pure functions of the
grid: safe to call from any thread, though the PNG takes tens to hundreds of milliseconds of CPU with the GIL held
for long stretches, so a server runs them in a process of their own (otel/heatmapviews.py), not on its event loop
nor on a thread beside it.
"""

from __future__ import annotations

import functools
import importlib.resources
import io
import json
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import jinja2

__all__ = ["render_html", "render_json", "render_png", "render_png_bytes", "script_json"]

PAGE_TEMPLATE = "heatmap.html.j2"
"""The HTML page's template, beside this module (package data of ``inferlb.otel``)."""

_KEYS = ("bucket_s", "times", "endpoints", "p95_ttft_s", "count", "latency_bounds_s", "latency_counts")


def _check_grid(grid: Mapping[str, Any]) -> None:
    if not isinstance(grid, Mapping):
        raise ValueError(f"a heatmap grid must be a mapping, not {type(grid).__name__}")
    missing = [key for key in _KEYS if key not in grid]
    if missing:
        raise ValueError(f"the heatmap grid lacks {', '.join(missing)}: pass HeatmapAggregator.grid()'s result")
    times, endpoints, bounds = grid["times"], grid["endpoints"], grid["latency_bounds_s"]
    shapes = (
        ("p95_ttft_s", grid["p95_ttft_s"], len(endpoints)),
        ("count", grid["count"], len(endpoints)),
        ("latency_counts", grid["latency_counts"], len(bounds) + 1),
    )
    for key, rows, expected in shapes:
        if not isinstance(rows, list) or len(rows) != expected:
            raise ValueError(f"grid[{key!r}] must be a list of {expected} rows")
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != len(times):
                raise ValueError(f"grid[{key!r}][{i}] must be a list of {len(times)} values, one per time bucket")
    if not (isinstance(grid["bucket_s"], int | float) and grid["bucket_s"] > 0):
        raise ValueError(f"grid['bucket_s'] must be seconds > 0; got {grid['bucket_s']!r}")


def render_json(grid: Mapping[str, Any]) -> bytes:
    """The grid as compact UTF-8 JSON (what the HTML page polls as ``heatmap.json``)."""
    _check_grid(grid)
    return json.dumps(dict(grid), separators=(",", ":"), allow_nan=False).encode("utf-8")


# --- PNG ------------------------------------------------------------------------------------------------------


def render_png_bytes(grid: Mapping[str, Any]) -> bytes:
    """The PNG of `render_png`, as bytes (what ``/heatmap.png`` answers)."""
    out = io.BytesIO()
    render_png(grid, out)
    return out.getvalue()


def render_png(grid: Mapping[str, Any], path: str | Path | IO[bytes], *, endpoint_counts: bool = False) -> None:
    """Write the two grids as a PNG to ``path``, a file name or a binary file (raises ``OSError`` if it cannot be
    written).

    Top: P95 TTFT per endpoint (rows) x time (columns), log colour scale, grey where there is no data; endpoints
    whose median P95 is at least twice the fleet's median have their label in red. Bottom: requests per TTFT
    bucket (log latency axis) x time, log colour scale. With ``endpoint_counts``, a panel between them shows the
    requests per endpoint x time (where traffic went). Time is UTC. Draws on matplotlib's Agg canvas directly, so
    it neither needs a display nor touches pyplot's global state.
    """
    _check_grid(grid)
    import matplotlib.dates as mdates
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    times: list[float] = [float(t) for t in grid["times"]]
    endpoints: list[str] = list(grid["endpoints"])
    bounds: list[float] = [float(b) for b in grid["latency_bounds_s"]]
    bucket_s = float(grid["bucket_s"])
    requests = sum(sum(row) for row in grid["count"])

    top_height = min(14.0, max(2.5, 0.28 * len(endpoints) + 1.2))
    middle_height = top_height if endpoint_counts else 0.0
    figure = Figure(figsize=(12, top_height + middle_height + 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(
        f"inferlb latency heatmap: {requests} requests, {len(endpoints)} endpoints, {bucket_s:g} s buckets"
        + _counters_note(grid)
    )
    if not times:
        figure.text(0.5, 0.5, "no LLM request spans in the window", ha="center", va="center", fontsize=14)
        figure.savefig(path, format="png")
        return
    if endpoint_counts:
        top, middle, bottom = figure.subplots(3, 1, sharex=True, height_ratios=[top_height, middle_height, 4.0])
    else:
        top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[top_height, 4.0])

    x = mdates.date2num([datetime.fromtimestamp(t, tz=UTC) for t in [*times, times[-1] + bucket_s]])
    span_s = times[-1] + bucket_s - times[0]
    date_format = "%H:%M:%S" if span_s <= 86400 else "%m-%d %H:%M"

    # Top: endpoint x time, P95 TTFT.
    p95 = np.array([[math.nan if v is None else float(v) for v in row] for row in grid["p95_ttft_s"]], dtype=float)
    p95 = p95.reshape(len(endpoints), len(times))
    values = p95[np.isfinite(p95)]
    cmap = _colormap("inferno", bad="#d9d9d9")
    if values.size:
        vmax = float(values.max())
        vmin = float(values[values > 0].min()) if (values > 0).any() else vmax
        vmin = max(vmin, 1e-4)
        vmax = max(vmax, vmin * 2)
        shown = np.ma.masked_invalid(np.clip(p95, vmin, None))
        mesh = top.pcolormesh(x, np.arange(len(endpoints) + 1), shown, cmap=cmap, norm=LogNorm(vmin, vmax))
        bar = figure.colorbar(mesh, ax=top, label="P95 TTFT", pad=0.01)
        _label_axis(bar.ax.yaxis, _seconds, subs=(1.0, 2.0, 5.0))
    else:
        top.pcolormesh(x, np.arange(len(endpoints) + 1), np.ma.masked_all(p95.shape), cmap=cmap)
        top.text(0.5, 0.5, "no TTFT values", transform=top.transAxes, ha="center", va="center")
    top.set_ylim(len(endpoints), 0)  # first endpoint at the top
    step = max(1, math.ceil(len(endpoints) / 45))
    ticks = list(range(0, len(endpoints), step))
    top.set_yticks([i + 0.5 for i in ticks], [endpoints[i] for i in ticks], fontsize=8)
    hot = _hot_rows(p95)
    for label, i in zip(top.get_yticklabels(), ticks, strict=True):
        if i in hot:
            label.set_color("#c00000")
            label.set_fontweight("bold")
    top.set_title("P95 time to first token per endpoint (grey: no requests)")
    top.set_ylabel("endpoint")
    if endpoint_counts:
        per_endpoint = np.array(grid["count"], dtype=float).reshape(len(endpoints), len(times))
        mesh = middle.pcolormesh(
            x, np.arange(len(endpoints) + 1), per_endpoint, cmap="Blues", vmin=0, vmax=max(1.0, per_endpoint.max())
        )
        figure.colorbar(mesh, ax=middle, label="requests", pad=0.01)
        middle.set_ylim(len(endpoints), 0)
        middle.set_yticks([i + 0.5 for i in ticks], [endpoints[i] for i in ticks], fontsize=8)
        middle.set_title("Requests per endpoint (where the traffic went)")
        middle.set_ylabel("endpoint")

    # Bottom: TTFT bucket x time, request counts.
    counts = np.array(grid["latency_counts"], dtype=float).reshape(len(bounds) + 1, len(times))
    low_ratio = bounds[1] / bounds[0] if len(bounds) > 1 else 2.0
    high_ratio = bounds[-1] / bounds[-2] if len(bounds) > 1 else 2.0
    y = np.array([bounds[0] / low_ratio, *bounds, bounds[-1] * high_ratio])
    peak = float(counts.max())
    mesh = bottom.pcolormesh(
        x,
        y,
        np.ma.masked_less_equal(counts, 0),
        cmap=_colormap("viridis", bad="white"),
        norm=LogNorm(1, max(peak, 2.0)),
    )
    bar = figure.colorbar(mesh, ax=bottom, label="requests", pad=0.01)
    _label_axis(bar.ax.yaxis, lambda v: f"{v:g}")
    bottom.set_yscale("log")
    _label_axis(bottom.yaxis, _seconds)
    bottom.set_ylim(y[0], y[-1])
    bottom.set_title("Requests per TTFT bucket, all endpoints (lowest and highest rows: under/over the bounds)")
    bottom.set_ylabel("TTFT")
    bottom.set_xlabel("time (UTC), bucket start")
    bottom.xaxis.set_major_formatter(mdates.DateFormatter(date_format, tz=UTC))
    bottom.xaxis_date(tz=UTC)
    figure.savefig(path, format="png")


def _seconds(value: float) -> str:
    """``0.25`` -> ``"250 ms"``, ``2.5`` -> ``"2.5 s"``: latencies as an operator reads them."""
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def _label_axis(axis: Any, text: Any, subs: tuple[float, ...] = (1.0,)) -> None:
    """Log-axis ticks at ``subs`` x powers of ten, labelled with ``text(value)``; minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda value, _: text(value)))
    axis.set_minor_formatter(NullFormatter())


def _colormap(name: str, *, bad: str) -> Any:
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad=bad)


def _hot_rows(p95: Any) -> set[int]:
    """Rows whose median P95 is at least twice the median of all rows' medians (needs 3+ rows with data)."""
    import numpy as np

    medians = {i: float(np.median(row[np.isfinite(row)])) for i, row in enumerate(p95) if np.isfinite(row).any()}
    if len(medians) < 3:
        return set()
    fleet = float(np.median(list(medians.values())))
    return {i for i, m in medians.items() if m >= 2 * fleet and m > 0}


def _counters_note(grid: Mapping[str, Any]) -> str:
    labels = {
        "dropped": "over the endpoint cap",
        "late": "older than the window",
        "invalid": "malformed",
        "unattributed": "no endpoint",
    }
    parts = [f"{grid[key]} {text}" for key, text in labels.items() if grid.get(key)]
    return f"\n(not shown: {', '.join(parts)})" if parts else ""


# --- HTML -----------------------------------------------------------------------------------------------------


def render_html(
    grid: Mapping[str, Any],
    *,
    refresh_s: float | None = 10.0,
    json_url: str | None = "heatmap.json",
    title: str = "inferlb latency heatmap",
) -> str:
    """A self-contained HTML page (inline CSS and JS, the grid embedded as JSON, no external resources) that draws
    the same two grids on canvases, with a hover read-out.

    Every ``refresh_s`` seconds (None: never) it fetches ``json_url`` (relative to the page; the JSON of
    `render_json`) and redraws; with ``json_url`` None, or when the page was opened from a file and the fetch
    fails, it reloads itself instead. A failed fetch keeps the data shown and says so on the page. Raises
    ``ValueError`` for a malformed grid or a ``refresh_s`` that is not a number of seconds > 0.
    """
    import html

    _check_grid(grid)
    if refresh_s is not None and not (
        isinstance(refresh_s, int | float) and not isinstance(refresh_s, bool) and math.isfinite(refresh_s)
    ):
        raise ValueError(f"refresh_s must be seconds > 0 or None; got {refresh_s!r}")
    if refresh_s is not None and refresh_s <= 0:
        raise ValueError(f"refresh_s must be seconds > 0 or None; got {refresh_s!r}")
    return _page().render(
        title=html.escape(title),
        data=script_json(dict(grid)),
        refresh_s=script_json(refresh_s),
        json_url=script_json(json_url),
    )


@functools.cache
def _page() -> jinja2.Template:
    """The page template (otel/heatmap.html.j2; a pure memo). Its values come in escaped for where they go: the
    title for HTML, the rest as JSON safe inside a <script> element; so Jinja2 escapes nothing."""
    text = importlib.resources.files("inferlb.otel").joinpath(PAGE_TEMPLATE).read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
    return env.from_string(text)


def script_json(value: Any) -> str:
    """JSON that is safe inside a <script> element: no '<', '>' or '&' that could end it or open a comment."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
