"""perf/ab.py on the CPU: its cells, its table, and that each worker imports its own version."""

from __future__ import annotations

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


@pytest.mark.parametrize("text", ["gemm:tp1:1", "stacked:tp1", "stacked:tp1:x",
                                  "kv:bf16:16:decode:extra", "c128:all:32:more"])
def test_malformed_cells_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cell"):
        ab.parse_cells(text)


def test_table_compares_bests_and_outputs() -> None:
    runs = {"old": [{"cell": "kv:bf16:16", "us": 10.0, "plan": "", "sha": "a"},
                    {"cell": "kv:bf16:16", "us": 12.0, "plan": "", "sha": "a"},
                    {"cell": "stacked:tp1:256", "us": 50.0, "plan": "m64 dp", "sha": "b"}],
            "new": [{"cell": "kv:bf16:16", "us": 9.0, "plan": "", "sha": "a"},
                    {"cell": "stacked:tp1:256", "us": 40.0, "plan": "m128 dp", "sha": "c"}]}
    kv, stacked = ab.table(runs).splitlines()[1:]
    assert kv.split()[:6] == ["kv:bf16:16", "10.00", "(", "12.0)", "9.00", "("]
    assert "0.900  SAME" in kv
    assert "0.800  DIFF" in stacked and stacked.endswith("m64 dp -> m128 dp")


def test_each_worker_imports_its_own_package(tmp_path) -> None:
    """The old worker must not import the repository's package (``python -m`` puts the working
    directory first on sys.path): a copy stands in for the other version."""
    old = tmp_path / "old"
    shutil.copytree(ab.ROOT / "cute_kernels", old / "cute_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    cache.mkdir()
    assert ab._run("old", old, cache, [], 2) == []  # raises if it imported another package
    assert ab._run("new", old, cache, [], 2) == []
