"""Stacked KV projection kernel against the PyTorch reference on the GPU.

Every check compares whole cache backings: written rows >= 99.9 % within 1 bf16 ulp of the
reference and all within rtol = atol = 2e-2 (a K head outside it only where the reference with
near-midpoint R1 sums rounded the other way reproduces it: testing.r1_flip_explains); every
other row (and the row padding) still holds the poison bytes.

Grid pruning (about two minutes on an H200): the full product H x L x n_kv x D x T x bias x
commit x padding is ~1000 cases of which most exercise the same code. Token counts cross every
tile edge (1, 7 inside one 64-row tile; 64 exactly one; 257 one row into the third 128-row
tile; 4096 the wide tile), so each runs against four (L, n_kv, H) shapes that cover both drafter
sizes and both kv widths (n_kv = 1: one head per tile and 20 K/V tiles per layer boundary;
n_kv = 8). The optional features (bias, commit rows, padded rows, bf16 norm weight) each change
the code independently of T's tile edges, so they run in four pairwise combinations at two
token counts (one per tile config). D = 64 and D = 256 change the epilogue mapping only, so
they run at two and one sizes. Every correctness test runs both GEMM cores (`impl`); each tile
config is also forced at two sizes.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import cute_kernels
from cute_kernels import reference, stacked_kv_proj
from cute_kernels.stacked_kv_proj.interface import KERNELS
from cute_kernels.stacked_kv_proj.plan import (
    CTAS_ENV,
    HANDOVER_ENV,
    IMPL_ENV,
    SCHEDULE_ENV,
    SPLITS_ENV,
    TILE_ENV,
    TILES,
    tiles_for,
    variants_for,
)
from cute_kernels.testing import POISON
from cute_kernels.testing import compare_stacked as compare
from cute_kernels.testing import stacked_kv_proj_case as make_case

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["wgmma", "mma"])
def impl(request, monkeypatch):
    """Both GEMM cores: TMA + wgmma (sm_90a only) and the portable cp.async + mma.sync."""
    if request.param == "wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs sm_90a")
    monkeypatch.setenv(IMPL_ENV, request.param)
    return request.param


# The 1-ulp statistic needs a sample that can resolve 99.9 %. The kernel's R1 comes from bf16
# tensor-core products with an fp32 accumulation whose order differs from the reference's, so
# a y value within ~1e-6 (relative) of a bf16 rounding midpoint may round the other way (about
# 0.1-0.2 % of values). In a K head one such flip changes the sum of squares, re-rounds a few
# R2 values by 1 ulp, and NeoX cancellation (x1*cos - x2*sin small) turns that into 2-10 ulp
# on up to four elements of the head. Measured on the H200 for D = 64, T = 7, n_kv = 1 (1280
# elements a round): every > 1 ulp element reproduced exactly by one 1-ulp R1 flip in its head.
# So the statistic is pooled over rounds of fresh inputs until MIN_ULP_SAMPLE elements.
MIN_ULP_SAMPLE = 16384


def _check(case, run=None, rounds: int = 2) -> None:
    """Poison both, run reference and kernel, compare; later rounds with fresh inputs. Rows
    that must not be written, and assert_close, are checked every round; the 1-ulp fraction
    over all rounds (more rounds for small cases, see MIN_ULP_SAMPLE)."""
    near = total = max_ulp = 0
    rnd = 0
    while rnd < rounds or (total < MIN_ULP_SAMPLE and rnd < 64):
        if rnd:  # fresh inputs, seeded: a failure reproduces
            gen = torch.Generator(device=case.ctx_hidden.device)
            gen.manual_seed(1000 * rnd + case.ctx_hidden.numel())
            case.ctx_hidden.normal_(generator=gen)
            case.positions.copy_(torch.randint(0, case.cos_sin_cache.shape[0],
                                               case.positions.shape, generator=gen,
                                               device=case.positions.device))
        case.poison()
        _, _, ref_k, ref_v = case.twin()  # poisoned copies with the same strides
        hidden_before = case.ctx_hidden.clone()
        reference.stacked_kv_proj(*case.args(ref_k, ref_v))
        (run or (lambda: stacked_kv_proj(*case.args())))()
        torch.cuda.synchronize()
        result = compare(case, ref_k, ref_v)
        assert result.untouched_equal, f"round {rnd}: a row that must be skipped was written"
        assert torch.equal(case.ctx_hidden, hidden_before), "ctx_hidden must not be modified"
        near += round(result.within_one_ulp * result.elements)
        total += result.elements
        max_ulp = max(max_ulp, result.max_ulp)
        rnd += 1
        if total == 0:
            break  # nothing is written (all rows skipped): nothing more to sample
    assert total == 0 or near / total >= 0.999, (
        f"{100 * near / total:.3f} % of {total} elements within 1 ulp over {rnd} rounds "
        f"(max {max_ulp} ulp)"
    )


SHAPES = [  # (L, n_kv, H)
    (5, 8, 4096),  # Qwen3-8B drafter, TP1
    (1, 1, 2560),  # one layer, one head (TP8): 2 CTAs of columns
    (5, 1, 2560),  # Qwen3-4B drafter at TP8
    (1, 8, 4096),
]


@pytest.mark.parametrize("tokens", [1, 7, 24, 64, 257, 4096])
@pytest.mark.parametrize(("layers", "n_kv", "hidden"), SHAPES, ids=str)
def test_matches_reference(layers, n_kv, hidden, tokens, impl):
    case = make_case(tokens, hidden, layers, n_kv, 128, "cuda", seed=tokens + 7 * n_kv)
    _check(case)


FEATURES = [  # bias, commit, row_pad, norm dtype: pairwise over the four flags
    dict(bias=True, commit=False, row_pad=8, norm_dtype=torch.float32),
    dict(bias=False, commit=True, row_pad=8, norm_dtype=torch.bfloat16),
    dict(bias=True, commit=True, row_pad=0, norm_dtype=torch.bfloat16),
    dict(bias=False, commit=False, row_pad=136, norm_dtype=torch.float32),
]


@pytest.mark.parametrize("tokens", [56, 1024])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(
    f"{k}={v}".replace("torch.", "") for k, v in f.items()))
def test_features(features, tokens, impl):
    case = make_case(tokens, 4096, 5, 8, 128, "cuda", seed=3, **features)
    _check(case)


@pytest.mark.parametrize(("tokens", "n_kv"), [(7, 1), (257, 4)])
def test_head_dim_64(tokens, n_kv, impl):
    case = make_case(tokens, 2560, 2, n_kv, 64, "cuda", bias=True, row_pad=8, seed=11)
    _check(case)


def test_head_dim_256(impl):
    case = make_case(300, 2560, 2, 2, 256, "cuda", commit=True, seed=12)
    _check(case)


@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("tokens", [7, 100])
@pytest.mark.parametrize(("n_kv", "head_dim"), [(8, 128), (4, 64)])
def test_every_tile_config(tile, tokens, n_kv, head_dim, impl, monkeypatch):
    """Each tile config of each core forced at sizes where auto would pick another; D = 64
    with 4 heads puts four heads in a wide (256-column) tile."""
    if tile not in tiles_for(impl):
        pytest.skip(f"the {impl} core has no {tile} tile")
    monkeypatch.setenv(TILE_ENV, tile)
    case = make_case(tokens, 2560, 2, n_kv, head_dim, "cuda", bias=True, commit=True, seed=15)
    _check(case)


SWAPPED_WGMMA_CASES = [  # (tile, tokens, H, L, n_kv, D, bias, commit)
    ("sw48", 300, 2560, 2, 1, 64, True, False),  # 64-row weight tiles: one consumer warpgroup
    ("sw80", 1, 4096, 5, 1, 128, False, False),  # T = 1: 79 zero-filled token rows
    ("sw32", 257, 448, 1, 2, 128, True, True),  # 7 k-tiles, 9 token tiles, the last 1 row
    ("sw256", 600, 2560, 3, 4, 64, True, True),  # two D = 64 heads a tile, 8 rows per thread
    ("sw160", 1000, 128, 2, 2, 128, False, False),  # H 128: fewer k-tiles than stages
    # the wide tiles: 256 weight rows, two m64 atoms a consumer warpgroup
    ("sw96w", 300, 2560, 2, 4, 64, True, True),  # four D = 64 heads a tile, 4 token tiles
    ("sw80w", 1, 4096, 5, 2, 128, False, False),  # T = 1: 79 zero-filled token rows
    ("sw80w", 257, 448, 1, 2, 128, True, True),  # 7 k-tiles, the last token tile 17 rows
    ("sw96w", 100, 2048, 2, 1, 128, True, False),  # kv = 128: the wide tile is 128 rows
]


@pytest.mark.parametrize("case_args", SWAPPED_WGMMA_CASES, ids=str)
def test_swapped_wgmma_tiles(case_args, monkeypatch):
    """The swapped wgmma tiles (the weight as the wgmma's M, the tokens as its N) forced on
    small and odd layouts, checked over three runs."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the swapped wgmma tiles are the wgmma core's (sm_90a)")
    tile, tokens, hidden, layers, n_kv, head_dim, bias, commit = case_args
    monkeypatch.setenv(IMPL_ENV, "wgmma")
    monkeypatch.setenv(TILE_ENV, tile)
    case = make_case(tokens, hidden, layers, n_kv, head_dim, "cuda", bias=bias, commit=commit,
                     seed=tokens + hidden)
    _check(case, rounds=3)


PERSISTENT_SWAPPED_CASES = [  # (tokens, H, L, n_kv, D, bias, commit, CTA cap) of sw128p
    (300, 2560, 2, 1, 64, True, False, None),  # kv 64: one consumer warpgroup, 3 token tiles
    (1000, 448, 2, 2, 128, True, True, 7),  # 7 k-tiles; ~9 tiles a CTA, the ring wraps
    (1, 4096, 5, 1, 128, False, False, None),  # T = 1: 127 zero-filled token rows
    (257, 4096, 5, 2, 128, False, False, None),  # the last token tile 1 row
    (600, 2560, 3, 4, 64, True, True, 5),  # two D = 64 heads a tile, 5 CTAs
    (1000, 128, 2, 2, 128, False, False, 3),  # H 128: 2 k-tiles a tile, 3 CTAs
]


@pytest.mark.parametrize("case_args", PERSISTENT_SWAPPED_CASES, ids=str)
def test_persistent_swapped_tiles(case_args, monkeypatch):
    """The persistent swapped tile (epilogue warpgroup, staged tile apart from the ring)
    forced on small and odd layouts, on grids that give each CTA many tiles, over three
    runs."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the swapped wgmma tiles are the wgmma core's (sm_90a)")
    tokens, hidden, layers, n_kv, head_dim, bias, commit, ctas = case_args
    monkeypatch.setenv(IMPL_ENV, "wgmma")
    monkeypatch.setenv(TILE_ENV, "sw128p")
    if ctas is not None:
        monkeypatch.setenv(CTAS_ENV, str(ctas))
    case = make_case(tokens, hidden, layers, n_kv, head_dim, "cuda", bias=bias, commit=commit,
                     seed=tokens + hidden + 1)
    _check(case, rounds=3)


def test_odd_k_tile_count(impl):
    """H = 448: 7 k-tiles, not a multiple of any ring depth."""
    case = make_case(33, 448, 2, 2, 128, "cuda", seed=16)
    _check(case)


def test_short_hidden(impl):
    """H = 128: fewer K tiles than pipeline stages."""
    case = make_case(70, 128, 2, 2, 128, "cuda", seed=13)
    _check(case)


STREAM_K_CASES = [  # (tokens, H, L, n_kv, D, tile, CTA cap)
    (1, 4096, 5, 1, 128, "auto", None),  # a TP-8 decode step: 10 tiles over every SM
    (64, 4096, 5, 1, 128, "auto", None),  # ~13 contributors per tile, 64 rows to share
    (7, 2560, 1, 1, 256, "auto", 7),  # n_kv 1, D 256, L 1: 2 tiles of 40 k-tiles over 7 CTAs
    (33, 448, 2, 2, 128, "auto", 5),  # H 448: 7 k-tiles, 56 iterations over 5 CTAs
    (100, 128, 2, 2, 128, "auto", None),  # 2 k-tiles: fewer k-tiles than the split
    (257, 2560, 5, 8, 128, "auto", None),
    (1000, 2560, 2, 2, 128, "m128", 13),  # 64 tiles on 13 CTAs: 39 data-parallel, 25 split
    (300, 2560, 2, 4, 64, "m128w", 11),  # four D = 64 heads in a wide tile, split
    (1024, 4096, 5, 1, 128, "m128", None),  # a TP-8 prefill: 80 tiles over every SM
    (1100, 4096, 2, 8, 128, "m128w", None),  # 81 wide tiles: the last one partial in rows
]


@pytest.mark.parametrize("case_args", STREAM_K_CASES, ids=str)
def test_stream_k(case_args, monkeypatch):
    """The stream-K schedule forced on small and odd layouts and splits: the partials of
    every tile reduced in order, each row finished once, skipped rows untouched."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the stream-K schedule is the wgmma core's (sm_90a)")
    *layout, tile, ctas = case_args
    _check_forced(monkeypatch, {IMPL_ENV: "wgmma", SCHEDULE_ENV: "streamk", TILE_ENV: tile,
                                CTAS_ENV: ctas}, layout, commit_every=7)


def _check_forced(monkeypatch, env: dict, layout: list, commit_every: int) -> None:
    """A schedule forced through ``env`` (values None are left unset) on the layout (tokens,
    H, L, n_kv, D), with bias, and with commit rows when T is a multiple of
    ``commit_every``: checked over three runs."""
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, str(value))
    tokens, hidden, layers, n_kv, head_dim = layout
    case = make_case(tokens, hidden, layers, n_kv, head_dim, "cuda", bias=True,
                     commit=tokens % commit_every == 0, seed=tokens + hidden)
    _check(case, rounds=3)


SPLIT_K_CASES = [  # (tokens, H, L, n_kv, D, tile, splits): the mma core's split K
    (1, 4096, 5, 1, 128, "auto", None),  # a TP-8 decode step: the planned split (8)
    (7, 2560, 1, 1, 256, "swap16", 5),  # n_kv 1, D 256, L 1: 40 k-tiles in 5 ranges
    (16, 448, 2, 2, 128, "swap16", 3),  # H 448: 7 k-tiles in 3 uneven ranges
    (5, 128, 2, 2, 128, "swap16", 4),  # 2 k-tiles: fewer than the split (capped at 2)
    (16, 4096, 3, 4, 64, "swap16", 32),  # 32 partials of 16 rows: three gather batches
    (3, 1024, 1, 1, 64, "swap16", 6),  # kv 64: more epilogue thread rows than tile rows
    (40, 1024, 2, 2, 128, "swap16", 3),  # 3 token tiles, the last one partial
    (100, 1024, 2, 2, 128, "m64", 3),  # split K on a data-parallel tile
    (16, 4096, 5, 1, 128, "swap16", 12),  # TP 8 on 120 CTAs: more splits than a cluster holds
]


@pytest.mark.parametrize("handover", ["cluster", "workspace", "auto"])
@pytest.mark.parametrize("case_args", SPLIT_K_CASES, ids=str)
def test_split_k(case_args, handover, monkeypatch):
    """The mma core's split K forced on small and odd layouts, with both hand-overs: every
    tile's partials summed in split order (in a cluster, each CTA its slice of the rows; over
    the workspace, the CTA that arrives last), skipped rows untouched; and the hand-over the
    planner picks for a forced split (the workspace past 8 splits)."""
    *layout, tile, splits = case_args
    if handover == "cluster" and (splits or 0) > 8:
        pytest.skip("a cluster holds at most 8 splits")
    _check_forced(monkeypatch, {IMPL_ENV: "mma", TILE_ENV: tile, HANDOVER_ENV: handover,
                                SPLITS_ENV: splits}, layout, commit_every=5)


SWAPPED_SPLIT_CASES = [  # (tokens, H, L, n_kv, D, tile, splits): a swapped wgmma tile split
    (1, 4096, 5, 1, 128, "sw32", 8),  # a TP-8 decode step: 10 weight tiles x 8 splits
    (64, 4096, 1, 8, 128, "sw32", 8),  # one layer: 2 x 16 tiles x 8 (two waves)
    (16, 448, 2, 2, 128, "sw32", 3),  # H 448: 7 k-tiles in 3 uneven ranges
    (5, 128, 2, 2, 128, "sw32", 4),  # 2 k-tiles: fewer than the split (capped at 2)
    (100, 1024, 2, 2, 64, "sw32", 6),  # D 64, two heads a tile; 4 token tiles, the last partial
    (256, 2048, 5, 1, 128, "sw32", 7),  # 8 token tiles, 4-5 rows a rank
    (3, 1024, 1, 1, 64, "sw32", 2),  # kv 64: one consumer warpgroup; 1 and 2 rows a rank
    (40, 2560, 1, 1, 128, "sw32", 5),  # one weight tile, two token tiles
]


@pytest.mark.parametrize("case_args", SWAPPED_SPLIT_CASES, ids=str)
def test_swapped_wgmma_split(case_args, monkeypatch):
    """The swapped wgmma tiles split along K in a cluster, forced on small and odd layouts:
    each CTA sums its slice of the rows of every partial through DSMEM, in split order, and
    finishes it; skipped rows untouched."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the swapped wgmma tiles are the wgmma core's (sm_90a)")
    *layout, tile, splits = case_args
    _check_forced(monkeypatch, {IMPL_ENV: "wgmma", TILE_ENV: tile, SPLITS_ENV: splits},
                  layout, commit_every=5)


OUT_OF_RANGE_PLANS = {  # every epilogue (registers, staged) and hand-over
    "wgmma-m128": {IMPL_ENV: "wgmma", TILE_ENV: "m128"},
    "wgmma-m64h": {IMPL_ENV: "wgmma", TILE_ENV: "m64h"},
    "wgmma-streamk": {IMPL_ENV: "wgmma", SCHEDULE_ENV: "streamk", TILE_ENV: "m64"},
    "wgmma-sw80": {IMPL_ENV: "wgmma", TILE_ENV: "sw80"},
    "wgmma-sw32-split": {IMPL_ENV: "wgmma", TILE_ENV: "sw32", SPLITS_ENV: "4"},
    "mma-m64": {IMPL_ENV: "mma", TILE_ENV: "m64"},
    "mma-swap16-cluster": {IMPL_ENV: "mma", TILE_ENV: "swap16", SPLITS_ENV: "4",
                           HANDOVER_ENV: "cluster"},
    "mma-swap16-workspace": {IMPL_ENV: "mma", TILE_ENV: "swap16", SPLITS_ENV: "4",
                             HANDOVER_ENV: "workspace"},
}


@pytest.mark.parametrize("plan", list(OUT_OF_RANGE_PLANS))
def test_out_of_range_indices_write_nothing(plan, monkeypatch):
    """Slots past the caches (into the guard rows behind them, and one at 2^40) and positions
    outside the cos/sin table skip their rows in every plan: the other rows as the reference,
    the guard rows untouched, no fault."""
    env = OUT_OF_RANGE_PLANS[plan]
    if env[IMPL_ENV] == "wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma core is sm_90a's")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tokens = 16 if "swap16" in plan else 100
    case = make_case(tokens, 1024, 2, 2, 128, "cuda", bias=True, out_of_range=True, seed=5)
    assert bool((case.cache_loc >= case.k_caches[0].shape[0]).any())
    _check(case, rounds=1)


@pytest.mark.parametrize(("tokens", "splits"), [(1, 8), (16, 5), (40, 3)])
def test_hand_overs_agree_bitwise(tokens, splits, monkeypatch):
    """Both hand-overs sum the same partials in the same order: identical bytes."""
    monkeypatch.setenv(IMPL_ENV, "mma")
    monkeypatch.setenv(TILE_ENV, "swap16")
    monkeypatch.setenv(SPLITS_ENV, str(splits))
    case = make_case(tokens, 2048, 2, 1, 128, "cuda", bias=True, seed=tokens)
    results = []
    stacked_kv_proj.forget_layouts()  # each call then asks for its compiled function
    with mock.patch.object(KERNELS, "get", wraps=KERNELS.get) as lookups:
        for handover in ("cluster", "workspace"):
            monkeypatch.setenv(HANDOVER_ENV, handover)
            case.poison()
            stacked_kv_proj(*case.args())
            torch.cuda.synchronize()
            results.append([b.clone() for b in (*case.k_backings, *case.v_backings)])
    keys = {call.args[0] for call in lookups.call_args_list}
    assert len(keys) == 2  # each hand-over its own compiled variant
    assert any(bool((b.view(torch.uint8) != POISON).any()) for b in results[0])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


SCHEDULES = {"dp": {SCHEDULE_ENV: "dp"}, "streamk": {SCHEDULE_ENV: "streamk"},
             "splitk": {IMPL_ENV: "mma", TILE_ENV: "swap16", SPLITS_ENV: "7",
                        HANDOVER_ENV: "workspace"},
             "splitk-cluster": {IMPL_ENV: "mma", TILE_ENV: "swap16", SPLITS_ENV: "7",
                                HANDOVER_ENV: "cluster"},
             "swapped-wgmma-split": {IMPL_ENV: "wgmma", TILE_ENV: "sw32", SPLITS_ENV: "7"}}


@pytest.mark.parametrize("n_kv", [1, 2])  # a 10 MiB weight, and a 20 MiB one: evict-first loads
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_bitwise_deterministic(schedule, n_kv, monkeypatch):
    """Two runs on the same inputs give identical bytes (the stream-K and split-K sums have a
    fixed order), with the weight's loads of either L2 policy (plan.EVICT_FIRST_WEIGHT_BYTES)."""
    for name, value in SCHEDULES[schedule].items():
        monkeypatch.setenv(name, value)
    case = make_case(64, 4096, 5, n_kv, 128, "cuda", seed=5)
    results = []
    for _ in range(3):
        case.poison()
        stacked_kv_proj(*case.args())
        torch.cuda.synchronize()
        results.append([b.clone() for b in (*case.k_backings, *case.v_backings)])
    assert any(bool((b.view(torch.uint8) != POISON).any()) for b in results[0])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_all_rows_skipped():
    case = make_case(64, 2560, 1, 1, 128, "cuda", seed=14)
    case.cache_loc.fill_(-1)
    _check(case, rounds=1)


def _check_graph_replay(case) -> None:
    """Capture one call, mutate inputs the kernel reads on the device, check the replays."""
    stacked_kv_proj(*case.args())  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        stacked_kv_proj(*case.args())
    case.commit_lens.copy_(torch.randint_like(case.commit_lens, 0, 9))  # read on device
    case.k_norm_weight.mul_(1.5)
    _check(case, run=graph.replay, rounds=3)


@pytest.mark.parametrize("schedule", ["dp", "streamk"])
@pytest.mark.parametrize("tokens", [7, 257])
def test_cuda_graph_replay_with_mutated_inputs(tokens, schedule, impl, monkeypatch):
    """Replays of one captured call (stream-K: its counters return to zero each time)."""
    monkeypatch.setenv(SCHEDULE_ENV, schedule)
    _check_graph_replay(make_case(tokens, 2560, 5, 8, 128, "cuda", commit=True, bias=True,
                                  seed=21))


@pytest.mark.parametrize("handover", ["cluster", "workspace"])
def test_cuda_graph_replay_of_a_decode_split(handover, monkeypatch):
    """A TP-8 decode step (10 weight tiles split 8 ways) captured once and replayed with
    mutated inputs: the workspace counters return to zero, the clusters need none."""
    monkeypatch.setenv(HANDOVER_ENV, handover)
    _check_graph_replay(make_case(7, 4096, 5, 1, 128, "cuda", commit=True, bias=True,
                                  seed=22))


def test_cuda_graph_replay_of_a_swapped_wgmma_split(monkeypatch):
    """The same TP-8 decode step on the swapped wgmma tile split 8 ways in clusters."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the swapped wgmma tiles are the wgmma core's (sm_90a)")
    monkeypatch.setenv(TILE_ENV, "sw32")
    monkeypatch.setenv(SPLITS_ENV, "8")
    _check_graph_replay(make_case(7, 4096, 5, 1, 128, "cuda", commit=True, bias=True,
                                  seed=22))


def test_torch_compile_fullgraph():
    case = make_case(100, 2560, 5, 8, 128, "cuda", bias=True, seed=31)

    @torch.compile(fullgraph=True)
    def step(x, weight, bias, norm_w, positions, cos_sin, loc, k_caches, v_caches):
        stacked_kv_proj(x * 1, weight, bias, norm_w, case.eps, positions, cos_sin, loc,
                        k_caches, v_caches)

    _check(case, run=lambda: step(case.ctx_hidden, case.weight, case.bias, case.k_norm_weight,
                                  case.positions, case.cos_sin_cache, case.cache_loc,
                                  case.k_caches, case.v_caches))


def test_compiles_are_per_variant_not_per_token_count():
    """Every token count runs one of the layout's few compiled variants (the tile is picked
    from T, the schedule is a runtime value): a sweep of token counts compiles at most one
    kernel per variant the arch has, and the same sweep again none."""
    counts = (1, 5, 17, 64, 65, 100, 256, 257, 300, 511, 1000, 2000)
    arch = f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}a"
    before = cute_kernels.cache_stats()["compiles"]
    for tokens in counts:
        stacked_kv_proj(*make_case(tokens, 2560, 5, 8, 128, "cuda").args())
    assert cute_kernels.cache_stats()["compiles"] - before <= len(variants_for(arch))
    before = cute_kernels.cache_stats()["compiles"]
    for tokens in counts:
        stacked_kv_proj(*make_case(tokens, 2560, 5, 8, 128, "cuda").args())
    torch.cuda.synchronize()
    assert cute_kernels.cache_stats()["compiles"] == before


def test_no_tokens_launches_nothing():
    case = make_case(0, 2560, 1, 1, 128, "cuda")
    stacked_kv_proj(*case.args())
    torch.cuda.synchronize()
    assert all(bool((b.view(torch.uint8) == 0xA5).all())
               for b in (*case.k_backings, *case.v_backings))
