"""perf/sweep_stacked.py on the CPU: a forced config sets exactly its overrides."""

from __future__ import annotations

import os

from perf import sweep_stacked


def _overrides() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("CUTE_KERNELS_STACKED_")}


def test_forced_sets_its_overrides_clears_every_other_and_leaves_none(monkeypatch) -> None:
    monkeypatch.setenv("CUTE_KERNELS_STACKED_HANDOVER", "workspace")
    monkeypatch.setenv("CUTE_KERNELS_STACKED_IMPL", "mma")
    with sweep_stacked.forced(sweep_stacked._parse_config("sw32/dp:4")):
        assert _overrides() == {"CUTE_KERNELS_STACKED_TILE": "sw32",
                                "CUTE_KERNELS_STACKED_SCHEDULE": "dp",
                                "CUTE_KERNELS_STACKED_SPLITS": "4"}
    with sweep_stacked.forced(None):  # the plan
        assert _overrides() == {}
    assert _overrides() == {}
