"""perf/report.py on synthetic results (CPU): the comparison, its CLI exit codes, the picture."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from perf import report

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def row(kernel: str, fmt: str, tokens: int, cold: float, **extra) -> dict:
    return {"kernel": kernel, "format": fmt, "tokens": tokens, "cold_us": cold,
            "hot_us": cold / 2, "host_us": cold + 10, "pct_of_copy_cold": 40.0,
            "exact": True, **extra}


def results(rows: list[dict], date: str = "2026-11-29 13:31:00 UTC") -> dict:
    return {"env": {"gpu": "NVIDIA H200", "date": date, "driver": "580", "torch": "2.11",
                    "cutlass_dsl": "4.8.1", "sms": 132},
            "copy_ceiling_Bps": 4.25e12, "rows": rows}


def base_rows() -> list[dict]:
    return [row("kv_rope_insert", fmt, t, 10.0 * t ** 0.5 + 5, pct_of_copy_cold=p)
            for fmt in ("v4_packed", "bf16") for t, p in ((1, 1.5), (512, 30.0), (65536, 70.0))]


def by_cell(changes: list[report.CellChange]) -> dict:
    return {(c.kernel, c.format, c.tokens, c.metric): c for c in changes}


# ---------------------------------------------------------------- compare


def test_compare_flags_exactly_the_cells_beyond_noise():
    old = results(base_rows())
    new = copy.deepcopy(old)
    cells = {(r["format"], r["tokens"]): r for r in new["rows"]}
    cells["v4_packed", 1]["cold_us"] *= 1.08      # slower beyond 5 %
    cells["bf16", 512]["hot_us"] *= 0.90          # faster beyond 5 %
    cells["bf16", 65536]["host_us"] *= 1.049      # slower, but within noise
    cells["v4_packed", 512]["cold_us"] *= 0.951   # faster, but within noise
    changes = report.compare(old, new)

    flagged = {k: c.flag for k, c in by_cell(changes).items() if c.flag}
    assert flagged == {
        ("kv_rope_insert", "v4_packed", 1, "cold_us"): report.REGRESSION,
        ("kv_rope_insert", "bf16", 512, "hot_us"): report.FASTER,
    }
    # every metric of every row compared: 6 rows x 3 metrics
    assert len(changes) == 18
    worse = by_cell(changes)["kv_rope_insert", "v4_packed", 1, "cold_us"]
    assert worse.old == pytest.approx(15.0) and worse.new == pytest.approx(16.2)
    assert worse.ratio == pytest.approx(1.08)


def test_noise_is_a_parameter():
    old = results(base_rows())
    new = copy.deepcopy(old)
    new["rows"][0]["cold_us"] *= 1.08
    assert [c.flag for c in report.compare(old, new, noise=0.10) if c.flag] == []
    assert [c.flag for c in report.compare(old, new, noise=0.02) if c.flag] == [report.REGRESSION]
    with pytest.raises(ValueError, match="noise"):
        report.compare(old, new, noise=-0.1)


def test_compare_reports_rows_of_one_side_and_skips_metrics_one_side_lacks():
    old = results(base_rows())
    new = copy.deepcopy(old)
    gone = new["rows"].pop(0)                          # only in old
    new["rows"].append(row("compress_c128", "all (4096 windows)", 4096, 540.0))  # only in new
    del new["rows"][0]["host_us"]                      # a metric the new run lacks
    new["rows"][1]["hot_us"] = None                    # an error in place of a time
    changes = report.compare(old, new)

    rows_only = {(c.kernel, c.format, c.tokens): c.flag for c in changes if c.metric is None}
    assert rows_only == {
        (gone["kernel"], gone["format"], gone["tokens"]): report.ONLY_OLD,
        ("compress_c128", "all (4096 windows)", 4096): report.ONLY_NEW,
    }
    cells = by_cell(changes)
    first, second = new["rows"][0], new["rows"][1]
    assert (first["kernel"], first["format"], first["tokens"], "host_us") not in cells
    assert (first["kernel"], first["format"], first["tokens"], "cold_us") in cells
    assert (second["kernel"], second["format"], second["tokens"], "hot_us") not in cells
    # 5 common rows x 3 metrics, less the 2 skipped, plus the 2 one-sided rows
    assert len(changes) == 5 * 3 - 2 + 2


def test_duplicate_cells_are_an_error():
    old = results(base_rows())
    new = copy.deepcopy(old)
    new["rows"].append(dict(new["rows"][0]))
    with pytest.raises(ValueError, match="two rows"):
        report.compare(old, new)


def test_format_comparison_puts_regressions_first_and_counts_them():
    old = results(base_rows())
    new = copy.deepcopy(old)
    new["rows"][5]["hot_us"] *= 1.5   # the last row: a regression must still be listed first
    new["rows"][2]["cold_us"] *= 0.5
    new["rows"].pop(3)
    text = report.format_comparison(report.compare(old, new))
    lines = text.splitlines()

    assert lines[0].split() == ["kernel", "format", "T", "metric", "old", "new", "new/old",
                                "flag"]
    assert lines[1].split()[:4] == ["kv_rope_insert", "bf16", "65536", "hot_us"]
    assert lines[1].endswith(report.REGRESSION)
    assert lines[1].split()[-2] == "1.500"
    assert lines[2].endswith("faster")
    assert lines[3].endswith(report.ONLY_OLD)
    assert sum(report.REGRESSION in line for line in lines) == 1
    assert lines[-1] == ("1 regression(s), 1 faster, 13 within noise; "
                         "rows only in old: 1, only in new: 0")
    assert len(lines) == 1 + 16 + 1  # header, one line per cell, summary


# ---------------------------------------------------------------- CLI


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perf.report", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_cli_compare_exit_codes(tmp_path):
    old = results(base_rows())
    new = copy.deepcopy(old)
    new["rows"][4]["cold_us"] *= 1.03  # within the default noise
    old_json, new_json = write(tmp_path / "old.json", old), write(tmp_path / "new.json", new)

    same = cli("--compare", str(old_json), str(new_json))
    assert same.returncode == 0, same.stderr
    assert "0 regression(s)" in same.stdout

    strict = cli("--compare", str(old_json), str(new_json), "--noise", "0.01")
    assert strict.returncode == 1, strict.stderr
    assert "1 regression(s)" in strict.stdout and report.REGRESSION in strict.stdout

    # a faster run and a run with a row missing do not fail
    new["rows"][4]["cold_us"] *= 0.5
    new["rows"].pop(0)
    faster = cli("--compare", str(old_json), str(write(new_json, new)))
    assert faster.returncode == 0, faster.stderr
    assert "1 faster" in faster.stdout and "rows only in old: 1" in faster.stdout


def test_cli_plot_writes_a_png(tmp_path):
    data = write(tmp_path / "results.json", results(base_rows()))
    done = cli("--plot", str(data))
    assert done.returncode == 0, done.stderr
    png = tmp_path / "summary.png"
    assert done.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE

    out = tmp_path / "pics" / "other.png"
    assert cli("--plot", str(data), "--out", str(out)).returncode == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_importing_the_module_does_not_need_matplotlib():
    code = "import sys, perf.report; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0


# ---------------------------------------------------------------- picture


def stacked_rows() -> list[dict]:
    # floor_us: the stacked GEMM's physical floor; pct_of_copy_cold is deliberately different
    return [row("stacked_kv_proj", "L5_nkv8_D128", t, cold, floor_us=floor, pct_of_copy_cold=5.0)
            for t, cold, floor in ((1024, 140.0, 112.0), (1, 35.0, 25.0), (64, 36.0, 25.2))]


def test_figure_one_axes_per_kernel_with_the_achieved_fractions():
    data = results(base_rows() + stacked_rows() + [
        row("compress_c128", "all (1 windows)", 1, 8.0, pct_of_copy_cold=1.5)])
    fig = report.figure(data)

    assert [ax.get_title() for ax in fig.axes] == ["kv_rope_insert", "stacked_kv_proj",
                                                   "compress_c128"]
    assert "NVIDIA H200" in fig.get_suptitle() and "2026-11-29" in fig.get_suptitle()
    kv, stacked, _ = fig.axes
    assert kv.get_xscale() == "log" and kv.xaxis.get_transform().base == 2
    assert kv.get_ylabel() == "fraction of copy ceiling"
    assert stacked.get_ylabel() == "fraction of GEMM floor"

    # matplotlib labels unlabelled lines (the 1.0 reference) "_child<n>"
    lines = {line.get_label(): line for line in kv.get_lines()
             if not line.get_label().startswith("_")}
    assert sorted(lines) == ["bf16", "v4_packed"]
    assert list(lines["bf16"].get_xdata()) == [1, 512, 65536]
    assert list(lines["bf16"].get_ydata()) == pytest.approx([0.015, 0.30, 0.70])
    assert lines["bf16"].get_marker() == "o"

    (gemm,) = [line for line in stacked.get_lines() if line.get_label() == "L5_nkv8_D128"]
    assert list(gemm.get_xdata()) == [1, 64, 1024]  # sorted by T
    assert list(gemm.get_ydata()) == pytest.approx([25 / 35, 25.2 / 36, 0.8])
    # the reference line at 1.0 on every axes
    for ax in fig.axes:
        assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())


def test_figure_splits_a_format_whose_rows_have_different_limits():
    rows = stacked_rows()
    del rows[0]["floor_us"]  # e.g. the floor could not be computed at one T
    (ax,) = report.figure(results(rows)).axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["L5_nkv8_D128 (of GEMM floor)"].get_xdata()) == [1, 64]
    assert list(lines["L5_nkv8_D128 (of copy ceiling)"].get_ydata()) == pytest.approx([0.05])
    assert ax.get_ylabel() == "fraction of GEMM floor / copy ceiling"


def test_plot_writes_a_non_empty_png(tmp_path):
    out = report.plot(results(base_rows() + stacked_rows()), tmp_path / "a" / "summary.png")
    assert out == tmp_path / "a" / "summary.png"
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


# ---------------------------------------------------------------- write_report


def test_write_report_writes_the_picture_and_the_comparison(tmp_path, capsys):
    old = results(base_rows(), date="2026-11-28 10:00:00 UTC")
    new = copy.deepcopy(old)
    new["env"]["date"] = "2026-11-29 13:31:00 UTC"
    new["rows"][0]["cold_us"] *= 2
    out = tmp_path / "results"

    written = report.write_report(new, out, old)
    assert written == [out / "summary.png", out / "compare.txt"]
    assert (out / "summary.png").read_bytes()[:8] == PNG_SIGNATURE
    text = (out / "compare.txt").read_text()
    assert "old: NVIDIA H200, 2026-11-28" in text and "new: NVIDIA H200, 2026-11-29" in text
    assert "1 regression(s)" in text
    assert text in capsys.readouterr().out

    # without an old run: the picture only, and no stale comparison left beside it
    assert report.write_report(new, out, None) == [out / "summary.png"]
    assert not (out / "compare.txt").exists()


def test_write_report_without_matplotlib(tmp_path, monkeypatch, capsys):
    # None in sys.modules makes every matplotlib import raise ModuleNotFoundError
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "summary.png").write_bytes(b"an earlier run's picture")
    written = report.write_report(results(base_rows()), tmp_path, results(base_rows()))
    assert written == [tmp_path / "compare.txt"]
    assert not (tmp_path / "summary.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_host_rounds_take_the_best_of_a_cell_and_its_rounds():
    """perf.timing.HostRounds: each round times every call once; a measured row's host time
    becomes the best of its own and the rounds', the rounds kept beside it; other rows stay."""
    from perf import timing

    times = iter([9.0, 30.0, 7.5, 31.0, 8.0, 29.0])
    rounds = timing.HostRounds({("kv_rope_insert", "bf16", 1): lambda: None,
                                ("stacked_kv_proj", "TP 1", 1): lambda: None})
    original = timing.host_us
    timing.host_us = lambda call: next(times)
    try:
        for _ in range(3):
            rounds.round()
    finally:
        timing.host_us = original
    rows = [row("kv_rope_insert", "bf16", 1, 4.0, host_us=10.0),
            row("stacked_kv_proj", "TP 1", 1, 30.0, host_us=28.0),
            row("kv_rope_insert", "bf16", 512, 5.0, host_us=11.0)]
    rounds.apply(rows)
    assert rows[0]["host_us"] == 7.5 and rows[0]["host_rounds_us"] == [9.0, 7.5, 8.0]
    assert rows[1]["host_us"] == 28.0 and rows[1]["host_rounds_us"] == [30.0, 31.0, 29.0]
    assert rows[2]["host_us"] == 11.0 and "host_rounds_us" not in rows[2]
