"""perf/ab.py on the CPU: its cells, its table, and that each worker imports its own version."""

from __future__ import annotations

import os
import shutil

import pytest

from perf import ab


def test_cells_parse_with_their_options() -> None:
    cells = ab.parse_cells("stacked:tp8:1024:m128:streamk, kv:bf16:65536:decode,c128:all:32")
    assert [c.name for c in cells] == ["stacked:tp8:1024:m128:streamk", "kv:bf16:65536:decode",
                                       "c128:all:32"]
    assert ab._stacked_env(cells[0]) == {"CUTE_KERNELS_STACKED_TILE": "m128",
                                         "CUTE_KERNELS_STACKED_SCHEDULE": "streamk"}
    assert ab._stacked_env(ab.parse_cells("stacked:tp1:64:auto:dp:66")[0]) == {
        "CUTE_KERNELS_STACKED_SCHEDULE": "dp", "CUTE_KERNELS_STACKED_CTAS": "66"}
    # T picks the stacked plan (its own warm-up); a KV format compiles once for every T
    groups = {c.compile_group for c in ab.parse_cells(
        "stacked:tp1:1,stacked:tp1:256,kv:fp8:1,kv:fp8:2048:decode")}
    assert len(groups) == 3


def test_a_cell_sets_its_overrides_and_clears_every_other(monkeypatch) -> None:
    # a caller's (or the previous cell's) split, hand-over and core would change the plan
    for name, value in (("CUTE_KERNELS_STACKED_SPLITS", "3"), ("CUTE_KERNELS_STACKED_IMPL", "mma"),
                        ("CUTE_KERNELS_STACKED_HANDOVER", "workspace"),
                        ("CUTE_KERNELS_STACKED_TILE", "m128")):
        monkeypatch.setenv(name, value)
    ab._apply_stacked_env(ab.parse_cells("stacked:tp8:1:auto:dp")[0])
    assert {k: v for k, v in os.environ.items() if k.startswith("CUTE_KERNELS_STACKED_")} == {
        "CUTE_KERNELS_STACKED_SCHEDULE": "dp"}
    ab._apply_stacked_env(ab.parse_cells("stacked:tp8:1:swap16:auto:auto:4")[0])
    assert {k: v for k, v in os.environ.items() if k.startswith("CUTE_KERNELS_STACKED_")} == {
        "CUTE_KERNELS_STACKED_TILE": "swap16", "CUTE_KERNELS_STACKED_SPLITS": "4"}


@pytest.mark.parametrize("text", ["gemm:tp1:1", "stacked:tp1", "stacked:tp1:x",
                                  "kv:bf16:16:decode:extra", "c128:all:32:more",
                                  "stacked:tp1:1:m64:dp:80:2:extra"])
def test_malformed_cells_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cell"):
        ab.parse_cells(text)


def test_table_compares_bests_and_outputs() -> None:
    runs = {"old": [{"cell": "kv:bf16:16", "us": 10.0, "plan": "", "sha": "a"},
                    {"cell": "kv:bf16:16", "us": 12.0, "plan": "", "sha": "a"},
                    {"cell": "stacked:tp1:256", "us": 50.0, "plan": "m64 dp", "sha": "b"}],
            "new": [{"cell": "kv:bf16:16", "us": 9.0, "plan": "", "sha": "a"},
                    {"cell": "stacked:tp1:256", "us": 40.0, "plan": "m128 dp", "sha": "c"}]}
    kv, stacked, stacked_hashes = ab.table(runs).splitlines()[1:]
    assert kv.split()[:6] == ["kv:bf16:16", "10.00", "(", "12.0)", "9.00", "("]
    assert "0.900  SAME" in kv
    assert "0.800  DIFF" in stacked and stacked.endswith("m64 dp -> m128 dp")
    assert stacked_hashes.strip() == "hashes: old b; new c"  # which run differed


def test_table_gives_hot_times_a_line_of_their_own() -> None:
    runs = {"old": [{"cell": "kv:fp8:2048", "us": 6.0, "hot_us": 2.5, "plan": "", "sha": "a"},
                    {"cell": "kv:fp8:2048", "us": 6.2, "hot_us": 2.4, "plan": "", "sha": "a"}],
            "new": [{"cell": "kv:fp8:2048", "us": 6.0, "hot_us": 1.8, "plan": "", "sha": "a"}]}
    cold, hot = ab.table(runs).splitlines()[1:]
    assert "1.000  SAME" in cold
    assert hot.split() == ["hot", "2.40", "(", "2.5)", "1.80", "(", "1.8)", "0.750"]


def test_each_worker_imports_its_own_package(tmp_path) -> None:
    """A worker imports the package of its folder, not the repository's (``python -m`` puts
    the working directory first on sys.path): a copy stands in for the other version, as old
    and as ``--new``."""
    old = tmp_path / "old"
    shutil.copytree(ab.ROOT / "cute_kernels", old / "cute_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    cache.mkdir()
    assert ab._run("old", old, cache, [], 2) == []  # raises if it imported another package
    assert ab._run("new", ab.ROOT, cache, [], 2) == []
    assert ab._run("new", old, cache, [], 2) == []  # --new: a branch's package, not the repo's


def test_a_cell_builds_calls_and_hashes_on_cpu_stand_ins(monkeypatch) -> None:
    """The worker's measurement of each op with the make perf inputs built on the CPU, the
    compiled functions recording their calls (``cpu_launches``) and a timer that calls once:
    one timed and one poisoned call per cell, the stacked plan named, a hash of the caches."""
    import torch

    from cute_kernels.testing import cpu_launches
    from perf import bench_compress_c128, bench_kv_rope_insert, bench_stacked_kv_proj

    for module, name in ((bench_kv_rope_insert, "kv_rope_insert_case"),
                         (bench_compress_c128, "compress_c128_case"),
                         (bench_stacked_kv_proj, "stacked_kv_proj_case")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: real(
            *("cpu" if x == "cuda" else x for x in a), **k))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    for name in ab.STACKED_ENV:  # a cell sets its overrides: restored after the test
        monkeypatch.delenv(name, raising=False)

    class OneCall:
        def cold_us(self, fn) -> float:
            fn()
            return 1.5

    cells = ab.parse_cells("stacked:tp8:64:m64:dp,kv:fp8:16:decode,c128:all:4")
    with cpu_launches() as launches:
        rows = [ab._measure(cell, OneCall()) for cell in cells]
    assert [len(launches)] == [6]
    assert [launch.key.cache_format.value for launch in launches[2:4]] == ["fp8", "fp8"]
    assert [r["cell"] for r in rows] == [c.name for c in cells]
    assert rows[0]["plan"].startswith("m64 dp") and rows[1]["plan"] == rows[2]["plan"] == ""
    assert all(r["us"] == 1.5 and len(r["sha"]) == 16 and "hot_us" not in r for r in rows)

    class OneCallHot(OneCall):
        def hot_us(self, fn) -> float:
            fn()
            return 0.5

    with cpu_launches() as launches:  # --hot: the cold call, the hot one, the poisoned one
        row = ab._measure(cells[1], OneCallHot(), hot=True)
    assert len(launches) == 3 and row["us"] == 1.5 and row["hot_us"] == 0.5
