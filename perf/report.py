"""``make perf`` as a report: a picture of ``results.json`` and a cell-by-cell comparison of two
runs.

``python -m perf.report --plot RESULTS.json [--out PNG]`` draws, per kernel, the achieved fraction
of the physical limit against T (one line per format). ``python -m perf.report --compare OLD.json
NEW.json [--noise 0.05]`` prints the change of every timed cell and exits 1 when any cell got
slower by more than the noise. :func:`write_report` is both, for ``perf/run.py`` to call once
results.json is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS = ("cold_us", "hot_us", "host_us")
REGRESSION, FASTER, SAME = "REGRESSION", "faster", ""
ONLY_OLD, ONLY_NEW = "only in old", "only in new"
# regressions first, so they are what a reader (or a CI log tail) sees first
_FLAG_ORDER = {REGRESSION: 0, FASTER: 1, ONLY_OLD: 2, ONLY_NEW: 3, SAME: 4}

Key = tuple[str, str, int]


def _time(row: dict, key: str) -> float | None:
    """A positive time, or None (absent, or an error recorded in its place)."""
    value = row.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


# ---------------------------------------------------------------- picture


def achieved(row: dict) -> tuple[float, str] | None:
    """The row's achieved fraction of its limit and the limit's name, or None when the row lacks
    the numbers (a failed cell). A row with ``floor_us`` (a GEMM's physical floor time) is
    measured against that floor; every other row against the copy ceiling."""
    floor, cold = _time(row, "floor_us"), _time(row, "cold_us")
    if floor is not None and cold is not None:
        return floor / cold, "GEMM floor"
    if isinstance(row.get("pct_of_copy_cold"), int | float):
        return row["pct_of_copy_cold"] / 100, "copy ceiling"
    return None


def figure(results: dict) -> Figure:
    """One subplot per kernel: achieved fraction against T (log2), one line per format."""
    # Lazy: importing this module (perf/run.py does) must not need matplotlib. The Figure is
    # drawn on an explicit Agg canvas, so no global backend is switched and no display is needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    # kernel -> (format, limit) -> [(T, fraction)], in the order the rows came
    series: dict[str, dict[tuple[str, str], list[tuple[int, float]]]] = {}
    for row in results["rows"]:
        point = achieved(row)
        if point is not None:
            lines = series.setdefault(row["kernel"], {})
            lines.setdefault((row["format"], point[1]), []).append((row["tokens"], point[0]))

    env = results.get("env", {})
    fig = Figure(figsize=(9, 3.2 * max(1, len(series))), layout="constrained")
    FigureCanvasAgg(fig)
    title = f"cute-kernels perf — {env.get('gpu', 'unknown GPU')}, {env.get('date', 'no date')}"
    if "copy_ceiling_Bps" in results:
        title += f"; copy ceiling {results['copy_ceiling_Bps'] / 1e12:.2f} TB/s"
    fig.suptitle(title)
    axes = fig.subplots(len(series), 1, squeeze=False)[:, 0] if series else []
    for ax, (kernel, lines) in zip(axes, series.items(), strict=True):
        limits = sorted({limit for _, limit in lines})
        tokens: set[int] = set()
        top = 1.0
        for (fmt, limit), points in lines.items():
            points.sort()
            xs, ys = zip(*points, strict=True)
            tokens.update(xs)
            top = max(top, *ys)
            # the limit is named per line only where one kernel mixes both kinds of row
            label = fmt if len(limits) == 1 else f"{fmt} (of {limit})"
            ax.plot(xs, ys, marker="o", markersize=4, label=label)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        # the measured sizes as plain numbers read better than 2^k ticks
        ax.set_xticks(sorted(tokens), [str(t) for t in sorted(tokens)])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(0, top * 1.08)
        ax.set_title(kernel)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(f"fraction of {' / '.join(limits)}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot(results: dict, out_png: Path) -> Path:
    """Draw :func:`figure` of ``results`` into ``out_png``; returns the path."""
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure(results).savefig(out_png, dpi=120)
    return out_png


# ---------------------------------------------------------------- comparison


@dataclass(frozen=True)
class CellChange:
    """One metric of one (kernel, format, T) cell; ``metric`` is None for a row present in one
    run only. ``flag``: REGRESSION, FASTER, SAME (within noise), ONLY_OLD or ONLY_NEW;
    ``ratio`` is new / old."""

    kernel: str
    format: str
    tokens: int
    flag: str
    metric: str | None = None
    old: float | None = None
    new: float | None = None
    ratio: float | None = None


def _by_key(results: dict, side: str) -> dict[Key, dict]:
    rows: dict[Key, dict] = {}
    for row in results["rows"]:
        key = (row["kernel"], row["format"], row["tokens"])
        if key in rows:  # a silent overwrite would hide one of the two cells
            raise ValueError(f"{side}: two rows for kernel {key[0]}, format {key[1]!r}, T {key[2]}")
        rows[key] = row
    return rows


def compare(old: dict, new: dict, noise: float = 0.05) -> list[CellChange]:
    """Every metric of ``METRICS`` that both runs have, per (kernel, format, tokens) cell: a
    regression when new > old * (1 + noise), faster when new < old * (1 - noise); and one
    change per row that only one run has. Rows in the new run's order, then old-only rows."""
    if not 0 <= noise < 1:
        raise ValueError(f"noise must be in [0, 1), got {noise}")
    old_rows, new_rows = _by_key(old, "old"), _by_key(new, "new")
    changes = []
    for key, new_row in new_rows.items():
        old_row = old_rows.get(key)
        if old_row is None:
            changes.append(CellChange(*key, ONLY_NEW))
            continue
        for metric in METRICS:
            before, after = _time(old_row, metric), _time(new_row, metric)
            if before is None or after is None:
                continue
            if after > before * (1 + noise):
                flag = REGRESSION
            elif after < before * (1 - noise):
                flag = FASTER
            else:
                flag = SAME
            changes.append(CellChange(*key, flag, metric, before, after, after / before))
    changes += [CellChange(*key, ONLY_OLD)
                for key in old_rows if key not in new_rows]
    return changes


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def format_comparison(changes: list[CellChange]) -> str:
    """A table, one line per cell, regressions first, and a summary line."""
    header = ("kernel", "format", "T", "metric", "old", "new", "new/old", "flag")
    ordered = sorted(changes, key=lambda c: _FLAG_ORDER[c.flag])  # stable: row order kept
    table = [header] + [
        (c.kernel, c.format, str(c.tokens), c.metric or "(row)", _num(c.old, ".2f"),
         _num(c.new, ".2f"), _num(c.ratio, ".3f"), c.flag)
        for c in ordered
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    right = {2, 4, 5, 6}  # numbers right-aligned
    lines = [
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip()
        for line in table
    ]
    count = {flag: sum(c.flag == flag for c in changes) for flag in _FLAG_ORDER}
    lines.append(
        f"{count[REGRESSION]} regression(s), {count[FASTER]} faster, {count[SAME]} within noise; "
        f"rows only in old: {count[ONLY_OLD]}, only in new: {count[ONLY_NEW]}"
    )
    return "\n".join(lines) + "\n"


def _describe(results: dict) -> str:
    env = results.get("env", {})
    text = f"{env.get('gpu', 'unknown GPU')}, {env.get('date', 'no date')}"
    if "copy_ceiling_Bps" in results:  # a changed ceiling says the machine itself moved
        text += f", copy ceiling {results['copy_ceiling_Bps'] / 1e12:.2f} TB/s"
    return text


def comparison_report(old: dict, new: dict, noise: float = 0.05) -> tuple[str, int]:
    """The text of ``--compare`` (which runs, the noise, the table) and its regression count."""
    changes = compare(old, new, noise)
    text = (f"old: {_describe(old)}\nnew: {_describe(new)}\nnoise: ±{100 * noise:g} %\n\n"
            + format_comparison(changes))
    return text, sum(c.flag == REGRESSION for c in changes)


# ---------------------------------------------------------------- make perf, CLI


def _is_matplotlib(exc: ModuleNotFoundError) -> bool:
    """Whether the missing module is matplotlib (a different missing module is a real bug)."""
    return (exc.name or "").split(".")[0] == "matplotlib"


def write_report(results: dict, out_dir: Path, old: dict | None) -> list[Path]:
    """Write ``summary.png`` and, with ``old`` (an earlier run's results, read before this run
    overwrote its file), ``compare.txt`` (also printed) into ``out_dir``; returns the paths
    written. Without matplotlib the picture is skipped with a one-line note, so the run that
    measured everything does not fail here."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    png = out_dir / "summary.png"
    try:
        written.append(plot(results, png))
    except ModuleNotFoundError as exc:
        if not _is_matplotlib(exc):
            raise
        png.unlink(missing_ok=True)  # a picture of an earlier run must not pass for this one's
        print(f"perf.report: matplotlib is not installed, {png} not written")
    txt = out_dir / "compare.txt"
    if old is None:
        txt.unlink(missing_ok=True)  # likewise a comparison of an earlier run
    else:
        text, _ = comparison_report(old, results)
        txt.write_text(text)
        print(text, end="")
        written.append(txt)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.report")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plot", metavar="RESULTS.json", type=Path,
                      help="draw the achieved fraction of each kernel's limit against T")
    mode.add_argument("--compare", nargs=2, metavar=("OLD.json", "NEW.json"), type=Path,
                      help="print the change of every cell; exit 1 on any regression")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG for --plot (default: summary.png beside RESULTS.json)")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="relative change treated as noise by --compare (default 0.05)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        out = args.out or args.plot.with_name("summary.png")
        try:
            print(plot(json.loads(args.plot.read_text()), out))
        except ModuleNotFoundError as exc:
            if not _is_matplotlib(exc):
                raise
            parser.error("--plot needs matplotlib (pip install matplotlib)")
        return 0
    old, new = (json.loads(path.read_text()) for path in args.compare)
    text, regressions = comparison_report(old, new, args.noise)
    print(text, end="")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
