"""Planning of a stacked KV projection call, apart from its validation and with no DSL import:
which GEMM core, which CTA tile and which schedule (data-parallel or stream-K, and the grid),
for a validated layout, a token count and the GPU's resident CTA count.

The core and the tile are a compiled variant (``StackedKvProjKey`` holds the layout and them);
the schedule is a runtime argument of the wgmma core, so one compile per (layout, core, tile)
serves every token count and every schedule.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

from ..layouts import STACKED_K_TILE
from ..validation import fail

#: ``auto`` (default: wgmma on sm_90a, mma elsewhere), ``mma`` or ``wgmma`` (sm_90a only).
IMPL_ENV = "CUTE_KERNELS_STACKED_IMPL"
#: ``auto`` (default: by T, see :func:`choose_tile`) or a TILES name, to compare tiles.
TILE_ENV = "CUTE_KERNELS_STACKED_TILE"
#: ``auto`` (default, see :func:`choose_plan`), ``dp`` (data-parallel only) or ``streamk``.
SCHEDULE_ENV = "CUTE_KERNELS_STACKED_SCHEDULE"
SCHEDULES = ("auto", "dp", "streamk")
#: A cap on the wgmma core's grid (default: the resident CTA count), to force odd splits.
CTAS_ENV = "CUTE_KERNELS_STACKED_CTAS"
#: K splits per tile of the mma core (default: see :func:`choose_splits`), to compare splits.
SPLITS_ENV = "CUTE_KERNELS_STACKED_SPLITS"
#: How split tiles of the mma core hand their partials over: ``auto`` (default, see
#: :func:`split_plan`), ``cluster`` (DSMEM, at most CLUSTER_MAX_SPLITS) or ``workspace``.
HANDOVER_ENV = "CUTE_KERNELS_STACKED_HANDOVER"
HANDOVERS = ("auto", "cluster", "workspace")
#: Every override of the plan (what a call's environment read watches).
OVERRIDE_ENVS = (IMPL_ENV, TILE_ENV, SCHEDULE_ENV, CTAS_ENV, SPLITS_ENV, HANDOVER_ENV)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A CTA tile: ``bm`` tokens x ``bn`` stacked columns, ``bn`` from :func:`tile_n`."""

    name: str
    bm: int  # tokens per CTA tile
    wide: bool  # 256-column tiles where kv allows (two D = 128 heads: m64n256 wgmma)
    mma_stages: int  # cp.async ring depth cap of the mma core (the wgmma ring fills its budget)
    # Measured time of a wave of these tiles (one per SM) relative to a wave of m128: the
    # first wave, each further wave, and the most waves the tile is planned for (see
    # choose_tile)
    cost: float
    wave_cost: float = 0.0
    max_waves: int | None = None
    # Decode tile (mma core): the weight rows are the MMA's M and the bm tokens its N, so a
    # stage of the ring is nearly all weight (see swap_ring).
    swap: bool = False
    # Split-head tile (wgmma core): two CTAs of a 2-CTA cluster take half a head each, CTA h
    # the head columns [h D/4, (h + 1) D/4) and [D/2 + h D/4, ...) (the NeoX partners stay in
    # one CTA), and exchange the rows' sums of squares through DSMEM: twice the CTAs of the
    # whole-head tile for the layouts of few weight tiles.
    split_head: bool = False
    # Swapped wgmma tile: the weight tile is the wgmma's A (64 rows per consumer warpgroup)
    # and the bm tokens its N, so bm is any multiple of 8 up to 256 and the plan sizes it to
    # fill the SMs (few weight tiles: TP 4 / TP 8 ranks, one-layer drafters); the epilogue is
    # the staged one. Weight tiles of 64 or 128 rows (not D = 256).
    tokens_n: bool = False
    # Persistent swapped wgmma tile: one CTA per SM takes tiles in turn (wave costs: a CTA's
    # first tile and each further one), the epilogue on a warpgroup of its own overlapping the
    # next tile's MMAs (wgmma_swap_persistent).
    persistent: bool = False

    def columns(self, head_dim: int, kv: int) -> int:
        """Stacked columns of one CTA tile of this config."""
        if self.split_head:
            return head_dim // 2
        return tile_n(head_dim, kv, self.wide)


# Small T is weight-bandwidth bound: m64 keeps the most bytes in flight per weight tile (80
# CTAs for N = 10240). Larger T is math bound: 128-row tiles, and on the wgmma core 128 x 256
# (two consumer warpgroups of m64n256, the shape with the least SMEM and L2 operand traffic
# per MMA). Costs: the wgmma core's data-parallel waves, H200, 2026-12-02 01:22 UTC, cold,
# H 4096, D 128, the drafter at TP 1..8 and one layer, T = 256..2048, every tile forced
# (specs/stacked_kv_proj.md, "Tile choice"): a wave of m128 took 28.8-29.8 us first and
# 25-30 each after (more the more waves), m64 18.0-18.7 and ~15 up to the third wave (20-24
# beyond, where m128 measured faster in every cell), m128w 50-53 and ~52.
TILE_SMALL = TileConfig("m64", bm=64, wide=False, mma_stages=8, cost=0.62, wave_cost=0.5,
                        max_waves=3)
TILE_MEDIUM = TileConfig("m128", bm=128, wide=False, mma_stages=4, cost=1.0, wave_cost=0.96)
TILE_WIDE = TileConfig("m128w", bm=128, wide=True, mma_stages=0, cost=1.75, wave_cost=1.73)
# Decode sizes are a stream of the weight: a swapped tile of 16 tokens, split along K
# (choose_splits), each token tile reading the weight through L2. A 64-token swapped tile
# measured slower than the wgmma core at T = 32 and 64 in every layout but one
# (specs/stacked_kv_proj.md) and was dropped.
TILE_SWAP = TileConfig("swap16", bm=16, wide=False, mma_stages=8, cost=0.0, swap=True)
# Split-head tile: data-parallel in 2-CTA clusters, twice the CTAs of m64 at half its
# columns each. Same-run cold us against m64 (H200, 2026-12-01 22:38 UTC) where both fit one
# wave: TP 8 T 128 13.6 / 17.8, TP 8 T 256 17.0 / 18.0, TP 4 T 128 17.0 / 19.3, TP 2 T 64
# 21.2 / 23.3, one layer T 128 / 256 15.5 / 21.4, 18.2 / 21.9 (0.72-0.94x; 15.3 against m64's
# 17.9 at TP 8 T 256 on 2026-12-02); a second wave loses (TP 4 T 256 29.2 against 20.1).
TILE_SPLIT_HEAD = TileConfig("m64h", bm=64, wide=False, mma_stages=0, cost=0.51,
                             wave_cost=0.47, split_head=True)
#: The split-head tile is planned above this T. At T <= 32 the swapped split plan measured
#: as fast or faster in every layout tried (22:45 UTC, cold us, m64h against the plan before
#: it: TP 2 T 32 22.7 / 22.5, D 64 T 1 / 16 / 32 13.6 / 10.8, 13.3 / 11.7, 13.1 / 13.0, TP 8 at
#: H 2048 T 32 10.6 / 10.0); at T = 64 m64h won in all five layouts tried.
SPLIT_HEAD_MIN_TOKENS = 33
#: ... and, for whole-head tiles of at most 128 columns, only where the m64 tiles fill at most
#: this share of the SMs: the split-head tile doubles the CTAs and with them the token bytes
#: the L2 carries, and past it the next candidate (sw32 or m64) measured as fast or faster
#: (H200, 2026-12-04, cold us, against m64h forced: one layer, T = 144 / 256 18.1 / 18.6
#: against 19.5 / 19.1; TP 4, T = 144 / 176 18.2 / 18.5 against 23.7 / 19.9; TP 8, T = 272 /
#: 368 17.5 / 17.8 against 19.0 / 19.1; H 2048 x 1 x 1, T = 2048 12.1 against 13.3; below it
#: m64h wins, TP 8, T = 256 on 40 m64 tiles 15.3 against m64's 18.1). A D = 256 head is a
#: 256-column m64 tile, twice the weight a CTA: there m64h won at every count measured
#: (T = 768 / 1024: 24.8 / 28.6 against m64's 36.8 / 37.5).
SPLIT_HEAD_MAX_SM_SHARE = 1 / 3
#: The swapped wgmma tiles (``sw<N>``, N the wgmma's N) and the measured cost of one wave of
#: each, relative to m128's (H200, 2026-12-02 13:30 UTC, cold, `perf.sweep_stacked` with each
#: tile forced: one full wave of 110-132 CTAs at H 4096 took 16.0-17.5 us for sw32, 18-20
#: sw48, 19.6-21 sw64, 19.8-21.6 sw80, 22.3-23.5 sw96, 27.4-28.9 sw128, 32.4-34.4 sw160,
#: 37.5-39.6 sw192, 47.7-50.6 sw256, against 28.8-29.8 for m128). One CTA per tile, so a
#: further wave costs what the first does from 128 tokens (sw128 on 3 waves 79.1 us, sw256 on
#: 5 243.5) and ~1.3x it below (sw80 on 2 waves 47.0-48.4, sw96 48.1; TP 1, T = 256: sw96 on
#: 2 waves 53.3 against m64's 3 waves 48.4).
SWAPPED_WGMMA_WAVE_COSTS = {32: 0.56, 48: 0.63, 64: 0.68, 80: 0.70, 96: 0.77, 128: 0.95,
                            160: 1.12, 192: 1.30, 256: 1.65}
TILES_SWAPPED_WGMMA = tuple(
    TileConfig(f"sw{n}", bm=n, wide=False, mma_stages=0, cost=cost,
               wave_cost=cost * (1.3 if n < 128 else 1.0), tokens_n=True)
    for n, cost in SWAPPED_WGMMA_WAVE_COSTS.items())
#: The wide swapped wgmma tiles (``sw<N>w``): 256 weight rows where kv allows (two D = 128
#: heads, four of D = 64; two m64 atoms a consumer warpgroup), so half the weight tiles of
#: ``sw<N>`` and other tile counts to fill the SMs with. Measured cost of a first and of a
#: further wave, relative to m128's, from the same sweep as sw128 (H200, 2026-12-04 15:55 UTC,
#: cold, `perf.sweep_stacked`, H 4096 / 8192, TP 1 / 2 / 4, one layer, L 6 x n_kv 8, T = 256
#: ..2048, each tile forced; sw128's one wave 28.8-30.7 us there, its table cost 0.95): one
#: wave of sw80w took 33.5-36.2 us and each further one ~36, sw96w 38.4-41.2 and ~39. So a
#: wide tile costs what the narrow tile of its MMA work does (sw80w as sw160, sw96w as sw192;
#: sw64w 28.6-31.8 as sw128, sw128w 48.1-52.9 as sw256, neither kept): twice the weight rows
#: for half the tokens is no cheaper a FLOP, only other tile counts.
SWAPPED_WIDE_WGMMA_WAVE_COSTS = {80: (1.10, 1.15), 96: (1.27, 1.27)}
TILES_SWAPPED_WIDE_WGMMA = tuple(
    TileConfig(f"sw{n}w", bm=n, wide=True, mma_stages=0, cost=first, wave_cost=further,
               tokens_n=True)
    for n, (first, further) in SWAPPED_WIDE_WGMMA_WAVE_COSTS.items())
#: The swapped wgmma tiles are planned from this T: below, every tile is one token tile, and
#: the swapped split plan and m64 / m64h measured as fast or faster than sw32 could be
#: (TP 1, T = 64: sw64 32.0 us, m64 33.0; sw32 on two token tiles 36.5).
SWAPPED_WGMMA_MIN_TOKENS = 33
#: Most weight rows (columns of the stacked output) of a narrow swapped wgmma tile, two
#: consumer warpgroups of m64: so no swapped tile for D = 256 (a wide tile takes 256 rows only
#: as two or four whole heads of D <= 128).
SWAPPED_WGMMA_MAX_COLUMNS = 128
#: The swapped wgmma tiles that also compile split along K (``StackedVariant.cluster``): a
#: tile's K ranges on the CTAs of one cluster, partials summed through DSMEM. Only sw32: a
#: CTA's MMA work is ``2 N 128 H / S`` whatever T, and one SM's tensor pipe makes larger N
#: slower at every decode size measured (H200, 2026-12-02 20:00 UTC, cold us, TP 8, T = 1,
#: 8 splits: sw32 10.9, sw64 11.7, sw128 14.3; T = 64, best split: sw32 13.1, sw64 13.7,
#: sw128 15.6, sw256 26+; specs/stacked_kv_proj.md). Nor where larger N fills its tiles
#: (T = 64..512 at TP 2 / 4 / 8 and one layer, sw64 split 2 / 4 / 6 and sw128 split 2..8:
#: slower than the plan in all 16 cells, e.g. one layer, T = 256: sw64 21.3, sw128 26.2 at
#: best against sw32's 18.2; H200, 2026-12-04 18:54 UTC, PERF.md).
SPLIT_SWAPPED_WGMMA_TILES = ("sw32",)
#: Most CTAs of the split swapped plan: the best split measured on at most 80 CTAs in every
#: layout where it won (TP 8, T = 64 on 20 tiles: 3 / 4 / 6 / 8 splits 13.1 / 13.1 / 17.4 /
#: 16.7 us; one layer, T = 64 on 32 tiles: 2 / 3 / 4 splits 14.7 / 15.2 / 20.5; H 2048 x 1 x
#: 1 x 128, T = 256 on 16 tiles: 4 / 6 / 8 splits 10.1 / 9.7 / 12.7).
SPLIT_SWAPPED_MAX_CTAS = 80
#: ... and its fewest splits: on 2 it measured no faster than the plans before it (TP 4, T = 64
#: on 40 tiles: 15.4 and 16.7 us in two runs against m64h's 15.6; one layer, T = 64: 14.7 /
#: 14.8 against 15.3 / 15.2; TP 8, T = 128: 14.5 against 14.5), nor than one CTA a tile
#: (below; TP 2, T = 17 / 32 on 40 tiles: 19.9 / 20.7 against 18.7 / 18.9).
SPLIT_SWAPPED_MIN_SPLITS = 3
#: The split swapped plan's T range starts above the mma core's swapped tile (its 16 tokens),
#: where that tile needs a second token tile: from there sw32 (one token tile up to T = 32)
#: measured faster in every layout tried (H200, 2026-12-05 07:43 UTC, cold us, the plan
#: before -> sw32 as planned now, at T = 17 / 32): TP 8 (8 splits) 12.0 / 12.3 -> 11.2 / 11.5,
#: TP 4 (4) 15.2 / 15.1 -> 14.1 / 14.8, one layer (5; 4 and 6 measured) 13.8 / 13.9 -> 13.0 /
#: 13.2-13.7, and unsplit (below) TP 2 22.0 / 22.1 -> 18.7 / 18.9, TP 1 34.1 / 33.1 -> 29.8 /
#: 30.6 (the plan before: two swap16 token tiles, 160 CTAs).
SPLIT_SWAPPED_MIN_TOKENS = TILE_SWAP.bm + 1
#: ... but up to four of those token tiles (T <= 64), not on this many CTAs or fewer: there the
#: mma core's swapped tile, whose token tiles are half as tall, streams the weight on twice the
#: CTAs and measured faster. H200, same-run A/Bs, cold us: H 2048 x 1 x 1 x 128 at T = 17 / 32,
#: sw32 on 2 tiles x 8 splits (16 CTAs) 7.6 / 7.9 against swap16's 32 CTAs 6.8 / 6.9
#: (2026-12-05 17:12 UTC); at T = 33 / 48 / 64, sw32 on 32 CTAs 7.84 / 8.16 / 8.18 against
#: swap16's 48 / 48 / 64 CTAs 6.82 / 7.14 / 7.22, and H 4096 x 1 x 2 x 128 at T = 17 / 32, sw32
#: on 32 CTAs 9.33 / 9.50 against swap16's 64 CTAs 8.83 / 8.96 (2026-12-06 02:57 UTC). 48 sw32
#: CTAs (H 2048, T = 65) and more stay sw32: 72 and 80 CTAs won (above).
SPLIT_SWAPPED_SWAP16_MAX_CTAS = 32
SPLIT_SWAPPED_SWAP16_MAX_TOKENS = 4 * TILE_SWAP.bm
#: Where fewer splits than ``SPLIT_SWAPPED_MIN_SPLITS`` fit, sw32 runs one CTA a tile (no
#: hand-over) up to this T, if its tiles are one token tile or fill at least
#: ``UNSPLIT_SWAPPED_MIN_SHARE`` of ``SPLIT_SWAPPED_MAX_CTAS``: TP 1, T <= 32 (80 tiles) and
#: TP 2, T <= 32 (40) above, and TP 2, T = 48 / 64 (80 tiles) 19.1 / 19.0 against m64h's
#: 20.1 / 19.9. Not with two token tiles of 27..40 (2 splits' worth): TP 4, T = 48 / 64 (40
#: tiles) unsplit 17.8 / 18.0, 2 splits 16.6 / 16.5, the plan before 15.9 / 15.6; one layer
#: (32 tiles) 17.6 / 17.5, 15.0 / 14.9, 14.9 / 15.1. Between 41 and 59 tiles of two token
#: tiles (e.g. H 2048, L 6, n_kv 4, D 64 at T = 64: 48) it was not measured, and the plan
#: before stays.
UNSPLIT_SWAPPED_MAX_TOKENS = 64
UNSPLIT_SWAPPED_MIN_SHARE = 3 / 4
#: The persistent swapped wgmma tile (``sw128p``, wgmma_swap_persistent): one CTA per SM takes
#: its tiles in turn, the epilogue of one overlapping the next one's MMAs. Its time is a fixed
#: part plus one part per tile of the busiest CTA (H200, 2026-12-04 17:24 UTC, cold, forced,
#: TP 1..8 at T = 1024..4096: ~12 + 23 us x tiles a CTA, e.g. TP 1, T = 1024 (5 a CTA) 127.6 us
#: against sw80w's 137.4, TP 2, T = 2048 129.2 against sw160's 140.1, TP 1, T = 4096 (20)
#: 472.6); so its first "wave" (one tile a CTA) is dearer than sw128's and each further one
#: cheaper. In m128 waves of 29.3 us. Tried and not kept (PERF.md): the wide tiles (48..80
#: tokens) and other token counts (64..192), slower than the plan in every cell but sw160p
#: with a bf16 staged tile at TP 4 / TP 8, T = 2048..4096 (7-8 %; its costs not fitted).
TILE_PERSISTENT_SWAPPED = TileConfig("sw128p", bm=128, wide=False, mma_stages=0, cost=1.19,
                                     wave_cost=0.79, tokens_n=True, persistent=True)
#: ... planned up to this hidden size: at H 8192 (L 6, n_kv 8) it measured slower than the
#: plan before it at T = 512 / 2048 / 4096 (154.1 / 562.0 / 1117.5 against 148.6 / 545.7 /
#: 1099.5 us, same-run A/B, 2026-12-04 17:45 UTC), faster only at T = 8192 (2273.8 / 2376.7).
PERSISTENT_MAX_HIDDEN = 4096
TILES = {t.name: t for t in (TILE_SMALL, TILE_MEDIUM, TILE_WIDE, TILE_SWAP, TILE_SPLIT_HEAD,
                             *TILES_SWAPPED_WGMMA, *TILES_SWAPPED_WIDE_WGMMA,
                             TILE_PERSISTENT_SWAPPED)}
SWAP_TILES = tuple(name for name, t in TILES.items() if t.swap)
#: The largest T the swapped tile is planned for (the range its cost model was fitted on).
SWAP_MAX_TOKENS = 256
#: Weight bytes in flight (all split CTAs' rings together) that keep the H200's DRAM busy:
#: the best measured split put 6.5-10 MB of ring in flight in every layout (TP 8: 10 tiles x 8
#: splits of a 108 KiB ring; TP 1: 80 tiles unsplit; D = 256: 4 x 8 of 204 KiB); more CTAs
#: only add partials to gather.
SPLIT_IN_FLIGHT_BYTES = 8 << 20
#: Weight bytes from which both cores load the weight with the L2 evict_first policy
#: (``dsl_utils.evict_first_policy``): a weight read once per call then replaces its own lines
#: in the L2 instead of the dirty ones an earlier kernel left there (the benchmark's write
#: flush), whose write-back would share the DRAM with it. Same-run A/B, H200, 2026-12-02 00:11
#: UTC, cold us, without -> with: TP 1 (80 MiB) T 1 / 64 / 256 34.9 / 38.2 / 55.7 -> 30.7 /
#: 34.6 / 54.0, TP 2 (40 MiB) T 1 / 64 20.6 / 23.2 -> 18.8 / 21.2, TP 4 (20 MiB) T 1 / 64
#: 13.6 / 16.7 -> 13.0 / 15.5, one layer (16 MiB) T 1 12.9 -> 12.4, T >= 1024 within noise;
#: with a clean L2 the same cells within 3 %. TP 8 (10 MiB) lost: T 1 10.6 -> 10.8 (00:03
#: UTC), with the L2 clean 9.2 -> 9.5: below some size the write-back saved is less than what
#: the policy costs, so its loads carry no hint.
EVICT_FIRST_WEIGHT_BYTES = 12 << 20
#: Most K splits of a tile that form one cluster and hand their partials over through
#: distributed shared memory (the portable cluster size); more go through the workspace.
CLUSTER_MAX_SPLITS = 8
#: With more than one token tile, the cluster hand-over is planned only for at least this many
#: splits on at most one CTA per SM (H200, cold us against the workspace: TP 8, T = 32, 6
#: splits 12.3 against 13.1; H 5120 x 2 x 1 x 256, T = 100 / 144, 16.3 / 19.5 against 19.7 /
#: 22.8; TP 4 and one layer at 3 / 4 splits a tie; 2 splits not measured since the hand-over
#: loads only the split's ranks). The spec's "Which hand-over" has every measurement.
CLUSTER_MIN_SPLITS_MULTI_TILE = 3
#: SMEM of a swapped tile's ring: two CTAs per SM when the ring still holds this many stages,
#: else one CTA per SM with twice the budget (D = 256: 256 weight rows per stage).
SWAP_MIN_STAGES = 4
SWAP_SMEM_PER_SM = 220 * 1024  # of the 227 KiB an SM offers, less the per-CTA reserve


@dataclasses.dataclass(frozen=True)
class StackedLayout:
    """What validation learns from the arguments and the generated code depends on."""

    num_layers: int
    n_kv: int
    head_dim: int
    has_bias: bool
    has_commit: bool
    norm_dtype: str  # a layouts.NORM_DTYPES name
    arch: str

    @property
    def kv(self) -> int:
        return self.n_kv * self.head_dim

    @property
    def columns(self) -> int:
        """Rows of the stacked weight: K then V of every layer."""
        return self.num_layers * 2 * self.kv

    def weight_bytes(self, hidden: int) -> int:
        """Bytes of the bf16 stacked weight for hidden size ``hidden``."""
        return self.columns * hidden * 2


@dataclasses.dataclass(frozen=True)
class StackedVariant:
    """A compiled variant of a layout: the GEMM core and the CTA tile."""

    impl: str  # "wgmma" (TMA + wgmma, sm_90a only) | "mma" (cp.async + mma.sync, every arch)
    tile: str  # a TILES name
    # split K, the mma core or a swapped wgmma tile: the splits of a tile are one cluster and
    # hand their partials over through distributed shared memory (else, mma core only,
    # through the global workspace)
    cluster: bool = False


@dataclasses.dataclass(frozen=True)
class StackedPlan:
    """A call's plan: the variant, and the wgmma core's runtime schedule."""

    variant: StackedVariant
    stream_k: bool  # the tiles past dp_tiles are split over the grid along K
    grid: int  # CTAs launched (mma core: tiles x splits)
    dp_tiles: int  # tiles run data-parallel, a multiple of the grid (all of them without SK)
    splits: int = 1  # mma core, swapped wgmma tiles: CTAs per tile, each a k-tile range


def tiles_for(impl: str) -> tuple[str, ...]:
    """Tile configs a core compiles: the mma core has no wide tile (its SMEM-staged epilogue
    would need 135 KiB of fp32 C for 128 x 256), the swapped decode tiles are the mma core's,
    the split-head and swapped wgmma tiles the wgmma core's."""
    if impl == "wgmma":
        return tuple(name for name, t in TILES.items() if not t.swap)
    return tuple(name for name, t in TILES.items()
                 if not t.wide and not t.split_head and not t.tokens_n)


def swap_ring(tile: TileConfig, bn: int) -> tuple[int, int]:
    """(ring stages, CTAs per SM) of swapped tile ``tile`` with ``bn`` weight rows: two CTAs
    per SM (each its own k-range of the weight in flight) unless that leaves fewer than
    ``SWAP_MIN_STAGES`` stages, then one with the whole budget."""
    stage = (tile.bm + bn) * STACKED_K_TILE * 2
    for ctas in (2, 1):
        stages = min(tile.mma_stages, SWAP_SMEM_PER_SM // ctas // stage)
        if stages >= SWAP_MIN_STAGES or ctas == 1:
            return max(2, stages), ctas
    raise AssertionError("unreachable")


def tile_n(head_dim: int, kv: int, wide: bool = False) -> int:
    """Columns per CTA tile: a multiple of D that divides kv (so a tile never straddles the
    K/V boundary or a layer), 128 (256 for a wide tile) when possible."""
    if wide and kv % 256 == 0:
        return 256
    bn = max(head_dim, 128)
    return bn if kv % bn == 0 else head_dim


def wide_tile_differs(head_dim: int, kv: int) -> bool:
    """Whether a wide tile of this layout holds more columns than the narrow one (else it is
    the narrow tile under another name: not planned, not precompiled)."""
    return tile_n(head_dim, kv, True) > tile_n(head_dim, kv)


#: The GEMM cores, the default first where it compiles.
IMPLS = ("wgmma", "mma")


def impls_for(arch: str) -> tuple[str, ...]:
    """GEMM cores that compile for ``arch``: wgmma exists on sm_90a only."""
    return IMPLS if arch == "sm_90a" else ("mma",)


def choose_impl(arch: str) -> str:
    """The core a call uses on ``arch`` unless :func:`choose_plan` picks the swapped tile
    (``CUTE_KERNELS_STACKED_IMPL`` overrides; a forced swapped tile is the mma core's): wgmma
    on sm_90a, else mma."""
    wanted = os.environ.get(IMPL_ENV, "auto")
    if wanted == "auto":
        return "mma" if os.environ.get(TILE_ENV, "auto") in SWAP_TILES else impls_for(arch)[0]
    if wanted not in impls_for(arch):
        fail(IMPL_ENV, f"one of auto, {', '.join(impls_for(arch))} on {arch}", repr(wanted))
    return wanted


def forced_tile(impl: str) -> str | None:
    """The tile ``CUTE_KERNELS_STACKED_TILE`` forces (None for ``auto``), checked for ``impl``."""
    wanted = os.environ.get(TILE_ENV, "auto")
    if wanted == "auto":
        return None
    if wanted not in tiles_for(impl):
        fail(TILE_ENV, f"one of auto, {', '.join(tiles_for(impl))} for the {impl} core",
             repr(wanted))
    return wanted


def _expect_one_of(name: str, allowed: tuple[str, ...]) -> str:
    """Environment variable ``name`` (``auto`` when unset), checked to be one of ``allowed``."""
    wanted = os.environ.get(name, "auto")
    if wanted not in allowed:
        fail(name, f"one of {', '.join(allowed)}", repr(wanted))
    return wanted


def forced_schedule() -> str:
    """``CUTE_KERNELS_STACKED_SCHEDULE``, checked."""
    return _expect_one_of(SCHEDULE_ENV, SCHEDULES)


def _positive_int_env(name: str) -> int | None:
    """Environment variable ``name`` as a positive integer, checked (None when unset)."""
    wanted = os.environ.get(name)
    if wanted is None:
        return None
    if not wanted.isdigit() or int(wanted) < 1:
        fail(name, "a positive integer", repr(wanted))
    return int(wanted)


def ctas_cap() -> int | None:
    """``CUTE_KERNELS_STACKED_CTAS``, checked (None: no cap)."""
    return _positive_int_env(CTAS_ENV)


def forced_splits() -> int | None:
    """``CUTE_KERNELS_STACKED_SPLITS``, checked (None: the planned split)."""
    return _positive_int_env(SPLITS_ENV)


def forced_handover() -> str:
    """``CUTE_KERNELS_STACKED_HANDOVER``, checked (with a forced split of at most
    ``CLUSTER_MAX_SPLITS`` when it is ``cluster``)."""
    wanted = _expect_one_of(HANDOVER_ENV, HANDOVERS)
    if wanted == "cluster" and (forced_splits() or 1) > CLUSTER_MAX_SPLITS:
        fail(SPLITS_ENV, f"at most {CLUSTER_MAX_SPLITS} with {HANDOVER_ENV}=cluster",
             repr(os.environ[SPLITS_ENV]))
    return wanted


def check_overrides(arch: str | None) -> None:
    """Raise :class:`LayoutError` for an override the calls on ``arch`` would reject; with no
    arch (meta or CPU tensors, no ``CUTE_KERNELS_ARCH``), for a core or tile no arch has."""
    if arch is None:
        _expect_one_of(IMPL_ENV, ("auto", *IMPLS))
        tile = _expect_one_of(TILE_ENV, ("auto", *TILES))
    else:
        tile = forced_tile(choose_impl(arch)) or "auto"
    schedule = forced_schedule()
    if tile != "auto" and schedule == "streamk" and (TILES[tile].split_head
                                                     or TILES[tile].tokens_n):
        fail(SCHEDULE_ENV, f"auto or dp with {TILE_ENV}={tile} (a split-head or swapped "
             "wgmma plan is data-parallel)", repr(schedule))
    ctas_cap()
    splits = forced_splits() or 1
    handover = forced_handover()
    if tile != "auto" and TILES[tile].tokens_n and splits > 1:
        if tile not in SPLIT_SWAPPED_WGMMA_TILES:
            fail(TILE_ENV, f"one of {', '.join(SPLIT_SWAPPED_WGMMA_TILES)} with {SPLITS_ENV} > "
                 "1 (the swapped wgmma tiles compiled split)", repr(tile))
        if splits > CLUSTER_MAX_SPLITS:
            fail(SPLITS_ENV, f"at most {CLUSTER_MAX_SPLITS} with {TILE_ENV}={tile} (a swapped "
                 "wgmma tile's splits are one cluster)", repr(os.environ[SPLITS_ENV]))
        if handover == "workspace":
            fail(HANDOVER_ENV, f"auto or cluster with {TILE_ENV}={tile} and {SPLITS_ENV} > 1 "
                 "(a swapped wgmma tile hands its partials over in its cluster)",
                 repr(handover))


def check_tile_layout(head_dim: int, kv: int) -> None:
    """Raise :class:`LayoutError` when ``CUTE_KERNELS_STACKED_TILE`` forces a swapped wgmma
    tile on a layout whose whole-head tile has more weight rows than it holds (D = 256)."""
    wanted = os.environ.get(TILE_ENV, "auto")
    if (wanted in TILES and TILES[wanted].tokens_n
            and tile_n(head_dim, kv) > SWAPPED_WGMMA_MAX_COLUMNS):
        fail(TILE_ENV, f"a tile of at most {SWAPPED_WGMMA_MAX_COLUMNS} weight rows for D = "
             f"{head_dim} (a swapped wgmma tile)", repr(wanted))


#: Most CTAs that share one stream-K tile: bounds the partials its last contributor reads.
MAX_CONTRIBUTORS = 16

# When the default plan is stream-K (H200, 2026-12-01, cold, specs/stacked_kv_proj.md): at decode
# sizes where each data-parallel CTA would stream a long slice of the weight (D = 256, 4 tiles
# of 2.6 MB: 20-22 against 34 us in three runs). With 1 MB per tile (the TP-8 drafter layout)
# the two measured within run-to-run noise of each other, the reduction's fixed latency
# (partial store, release/acquire hand-over, gather, an exposed epilogue) eating what the
# extra SMs gain; at T >= 256 and in the last wave of large T data-parallel measured faster in
# every layout tried — also with the last contributor finishing each tile (2026-12-02 01:22
# UTC: e.g. TP 8, T = 1024 on m128 38.7 us against 30.0, TP 1, T = 1024 on m128w 182.2 against
# 155.6). Forced stream-K stays available (CUTE_KERNELS_STACKED_SCHEDULE).
STREAM_K_MAX_TOKENS = 64
STREAM_K_MIN_TILE_BYTES = 2 << 20  # weight bytes per data-parallel tile
STREAM_K_TILE = "m64"


def tile_count(tokens: int, layout: StackedLayout, tile: TileConfig) -> int:
    return -(-tokens // tile.bm) * (layout.columns // tile.columns(layout.head_dim, layout.kv))


def schedule(tiles: int, k_tiles: int, ctas: int, stream_k: bool) -> tuple[int, int]:
    """(grid, dp_tiles) of ``tiles`` tiles of ``k_tiles`` k-tiles on ``ctas`` resident CTAs.

    Data-parallel: one CTA per tile up to ``ctas``, striding. Stream-K: whole waves stay
    data-parallel except the last full one, which joins the remainder so that every CTA gets
    one to two tiles' worth of k-iterations (CUTLASS's "DP + SK" split); never more CTAs than
    iterations."""
    if not stream_k or tiles % ctas == 0:
        return min(tiles, ctas), tiles
    dp_tiles = (tiles // ctas - 1) * ctas if tiles >= 2 * ctas else 0
    # A tile meets at most ceil(grid / sk_tiles) + 1 ranges: keep that within
    # MAX_CONTRIBUTORS (binds only below 9 tiles, so never beside data-parallel waves).
    sk_tiles = tiles - dp_tiles
    return min(ctas, sk_tiles * min(k_tiles, MAX_CONTRIBUTORS - 1)), dp_tiles


def estimate(tiles: int, ctas: int, tile: TileConfig) -> float:
    """Time of a data-parallel schedule in units of one wave of m128: its first wave's cost and
    each further wave's (infinite beyond the tile's ``max_waves``)."""
    waves = -(-tiles // ctas)
    if tile.max_waves is not None and waves > tile.max_waves:
        return math.inf
    return tile.cost + (waves - 1) * tile.wave_cost


def choose_tile(tokens: int, impl: str, num_layers: int, n_kv: int, head_dim: int,
                sms: int, data_parallel: bool = True, hidden: int | None = None) -> str:
    """The data-parallel tile for ``tokens`` rows of a layout on core ``impl`` with ``sms``
    SMs (``CUTE_KERNELS_STACKED_TILE`` overrides): the least :func:`estimate`, a wave being one
    tile per SM, priced by the tile's measured wave costs. The wave count is what makes m128
    beat m128w at T = 512..1024 on the drafter layout (3 and 5 waves against 2 and 3), m64
    lose to m128 at T = 128 (two waves of 64-row tiles, one of 128) and beat m128w at TP 1,
    T = 256 (three short waves against one long one), the split-head tile win where its
    twice as many tiles still fit one wave (above ``SPLIT_HEAD_MIN_TOKENS``), and a swapped
    wgmma tile win where its token count fills the SMs in one wave where the others leave
    many idle (TP 8, T = 1024: 13 x 10 tiles of sw80), and the persistent swapped tile win
    where the CTAs take several tiles each (TP 1, T = 1024: 5 of sw128p against 4 waves of
    sw80w), up to ``PERSISTENT_MAX_HIDDEN`` (``hidden``; None: any). The split-head and
    swapped wgmma tiles are data-parallel only: with ``data_parallel`` False (a stream-K plan)
    neither."""
    forced = forced_tile(impl)
    if forced is not None:
        return forced
    layout = StackedLayout(num_layers, n_kv, head_dim, False, False, "float32", "")
    whole_head_columns = tile_n(head_dim, layout.kv)
    swapped_fits = whole_head_columns <= SWAPPED_WGMMA_MAX_COLUMNS
    wide_differs = wide_tile_differs(head_dim, layout.kv)
    split_head_fits = (whole_head_columns > 128 or tile_count(tokens, layout, TILE_SMALL)
                       <= sms * SPLIT_HEAD_MAX_SM_SHARE)

    def candidate(config: TileConfig) -> bool:
        if config.swap:
            return False
        if config.split_head:
            return data_parallel and tokens >= SPLIT_HEAD_MIN_TOKENS and split_head_fits
        if config.persistent and hidden is not None and hidden > PERSISTENT_MAX_HIDDEN:
            return False
        if config.tokens_n:
            return (data_parallel and swapped_fits and tokens >= SWAPPED_WGMMA_MIN_TOKENS
                    and (not config.wide or wide_differs))
        return True

    candidates = [name for name in tiles_for(impl) if candidate(TILES[name])]
    return min(candidates, key=lambda name:
               estimate(tile_count(tokens, layout, TILES[name]), sms, TILES[name]))


#: fp32 padding per row of the mma core's staged C tile (its 64-bit fragment stores then take
#: the minimum two wavefronts)
C_ROW_PAD = 8
#: ... and of the swapped wgmma core's: its transposed 4-byte stores put a warp's 4 token rows
#: (2 apart) 8 banks apart, beside 8 consecutive columns: no bank conflict
SWAPPED_C_ROW_PAD = 4


def ring_bytes(stages: int, bm: int, bn: int) -> int:
    """SMEM of an mma-core ring of ``stages`` stages of ``bm`` token and ``bn`` weight rows."""
    return stages * (bm + bn) * STACKED_K_TILE * 2


def gather_bytes(stages: int, bm: int, bn: int) -> int:
    """The part of that ring a split tile's last CTA gathers partials into: all of it beyond
    the staged fp32 C tile (``bm x (bn + C_ROW_PAD)``, a multiple of 16 bytes)."""
    return ring_bytes(stages, bm, bn) - bm * (bn + C_ROW_PAD) * 4


def gathered_partials(stages: int, bm: int, bn: int, rows: int) -> int:
    """How many fp32 partials of ``rows`` rows the last CTA of a split tile (a ring of
    ``stages`` stages of ``bm`` token and ``bn`` weight rows) gathers in one round trip (the
    kernel's batch, :func:`gather_bytes`)."""
    return max(1, gather_bytes(stages, bm, bn) // (rows * bn * 4))


def choose_splits(weight_tiles: int, tiles: int, k_tiles: int, sms: int, per_sm: int,
                  ring_bytes: int, gathered: int,
                  resident: Callable[[int], int] | None = None) -> int:
    """K splits per tile of a swapped plan of ``tiles`` tiles over ``weight_tiles`` weight
    tiles on ``sms`` SMs holding ``per_sm`` CTAs each (``CUTE_KERNELS_STACKED_SPLITS``
    overrides): enough CTAs that the rings of one token tile's CTAs (``ring_bytes`` each) hold
    ``SPLIT_IN_FLIGHT_BYTES`` of weight in flight (the other token tiles stream the same
    weight, from L2), all resident at once, no more partials than the last CTA gathers in one
    round trip (``gathered``), and never more splits than k-tiles.

    A grid just past one CTA per SM leaves a few SMs with two CTAs, and those set the time: so
    the split that keeps one CTA per SM is taken instead when the busiest SM's share of a
    tile's k-range, ``ceil(CTAs / sms) / splits``, is smaller with it (TP 8, T = 32: 4 splits
    on 80 CTAs 12.9 us, 8 splits on 160 CTAs 14.2; TP 2, T = 32: 2 splits on 160 CTAs 22.6,
    1 on 80 26.0, the busiest share being the same).

    ``resident(S)``, when given, is how many CTAs the GPU runs at once in clusters of ``S``
    (a cluster cannot span GPCs): the split is lowered until its grid fits."""
    forced = forced_splits()
    if forced is None:
        wanted = round(SPLIT_IN_FLIGHT_BYTES / (weight_tiles * ring_bytes))
        forced = max(1, min(wanted, sms * per_sm // tiles, gathered))
        one_per_sm = sms // tiles
        if 1 <= one_per_sm < forced and forced < -(-tiles * forced // sms) * one_per_sm:
            forced = one_per_sm
        while resident is not None and forced > 1 and tiles * forced > resident(forced):
            forced -= 1
    return max(1, min(k_tiles, forced))


# Cost model of the decode plans (cold µs on the H200 and its 132 SMs, 2026-12-01: least
# squares over the 2026-12-01 sweep of T = 32..256 in seven layouts, specs/stacked_kv_proj.md;
# rms error 1.4 µs for the swapped plan, 3.0 for the wgmma core). Both are a fixed cost plus
# each CTA's own stream of weight (the in-flight bound of one CTA), the weight's DRAM bytes,
# and: for the swapped tile, every token tile's read of the weight from L2 (per SM); for the
# wgmma core, its MMA work per CTA. The wgmma core streams a CTA's bytes twice as fast (one
# CTA per SM with a 3-4x larger ring), the swapped plan splits them over more CTAs.
#: (fixed, per MB per CTA, per MB of L2 reads per SM, per weight MB)
SWAP_COST_US = (9.33, 7.75, 4.16, 0.138)
#: (fixed, per MB per CTA, per GFLOP per CTA, per weight MB)
WGMMA_COST_US = (7.40, 3.73, 76.3, 0.216)


def swap_estimate_us(weight_bytes: int, cta_bytes: float, token_tiles: int, sms: int) -> float:
    """Estimated cold time of a swapped plan: ``cta_bytes`` of weight per CTA, ``token_tiles``
    token tiles each reading all ``weight_bytes``, on ``sms`` SMs."""
    fixed, per_cta, per_l2, per_weight = SWAP_COST_US
    return (fixed + per_cta * cta_bytes / 1e6 + per_l2 * token_tiles * weight_bytes / sms / 1e6
            + per_weight * weight_bytes / 1e6)


def wgmma_estimate_us(weight_bytes: int, cta_bytes: float, cta_flops: float) -> float:
    """Estimated cold time of a data-parallel wgmma plan whose busiest CTA streams
    ``cta_bytes`` of weight and does ``cta_flops`` of MMA."""
    fixed, per_cta, per_gflop, per_weight = WGMMA_COST_US
    return (fixed + per_cta * cta_bytes / 1e6 + per_gflop * cta_flops / 1e9
            + per_weight * weight_bytes / 1e6)


#: CTAs resident at once in clusters of ``size`` at ``per_sm`` CTAs per SM (the driver's
#: occupancy calculator, ``arch.max_active_clusters``); the plans take it as an argument.
ClusterResidency = Callable[[int, int], int]


def formula_residency(sms: int) -> ClusterResidency:
    """What :data:`ClusterResidency` would be if clusters could span GPCs: an upper bound."""
    return lambda size, per_sm: sms * per_sm // size * size


def split_plan(layout: StackedLayout, tile: str, tokens: int, hidden: int, ctas: int,
               residency: ClusterResidency, handover: str) -> StackedPlan:
    """The mma core's plan of ``tile`` with its split and hand-over. ``handover`` ``cluster``
    or ``workspace`` forces one; ``auto`` takes the cluster one, for at most
    ``CLUSTER_MAX_SPLITS`` splits (a forced split may be more), on a swapped tile with one
    token tile (T <= 16: faster in every measured layout, the workspace hand-over costing
    1.7-3.9 us of the TP 2..8 decode plans, the cluster one 0.1-1.9), or with at least
    ``CLUSTER_MIN_SPLITS_MULTI_TILE`` splits on at most one CTA per SM; its split is at most
    ``CLUSTER_MAX_SPLITS`` and lowered until all clusters are resident at once
    (``residency``)."""
    config = TILES[tile]
    bn = tile_n(layout.head_dim, layout.kv, config.wide)
    weight_tiles = layout.columns // bn
    tiles = tile_count(tokens, layout, config)
    k_tiles = hidden // STACKED_K_TILE
    if not config.swap:  # a data-parallel tile: split only when forced
        splits = min(forced_splits() or 1, k_tiles)
        cluster = handover == "cluster" and splits > 1
        return StackedPlan(StackedVariant("mma", tile, cluster), False, tiles * splits, tiles,
                           splits)
    stages, per_sm = swap_ring(config, bn)

    def splits_for(cluster: bool) -> int:
        if cluster:
            return choose_splits(weight_tiles, tiles, k_tiles, ctas, per_sm,
                                 ring_bytes(stages, config.bm, bn), CLUSTER_MAX_SPLITS,
                                 lambda size: residency(size, per_sm))
        return choose_splits(weight_tiles, tiles, k_tiles, ctas, per_sm,
                             ring_bytes(stages, config.bm, bn),
                             gathered_partials(stages, config.bm, bn, min(tokens, config.bm)))

    if handover == "auto":
        splits = splits_for(True)
        # (a forced split past CLUSTER_MAX_SPLITS: the cluster hand-over sums no more partials)
        cluster = splits <= CLUSTER_MAX_SPLITS and (
            tiles == weight_tiles
            or (splits >= CLUSTER_MIN_SPLITS_MULTI_TILE and tiles * splits <= ctas))
        if not cluster:
            splits = splits_for(False)
    else:
        cluster = handover == "cluster"
        splits = splits_for(cluster)
    return StackedPlan(StackedVariant("mma", tile, cluster and splits > 1), False,
                       tiles * splits, tiles, splits)


def swap_plan(layout: StackedLayout, tokens: int, hidden: int, ctas: int,
              residency: ClusterResidency) -> tuple[StackedPlan, float]:
    """The split swapped plan of a call and its estimated time: infinite when its tiles do not
    all fit on the GPU at once (a second wave of weight streams measured 1.5-2.2x slower than
    the wgmma core at TP 1, T = 64 and 128)."""
    plan = split_plan(layout, TILE_SWAP.name, tokens, hidden, ctas, residency, forced_handover())
    bn = tile_n(layout.head_dim, layout.kv)
    per_sm = swap_ring(TILE_SWAP, bn)[1]
    estimate_us = math.inf
    if plan.dp_tiles <= ctas * per_sm:
        estimate_us = swap_estimate_us(layout.weight_bytes(hidden),
                                       bn * hidden * 2 / plan.splits,
                                       plan.dp_tiles // (layout.columns // bn), ctas)
    return plan, estimate_us


def decode_swapped_plan(layout: StackedLayout, tokens: int, hidden: int, ctas: int,
                        residency: ClusterResidency) -> StackedPlan | None:
    """The swapped plan of a decode call, or None where it is not the plan: sw32 tiles,
    each split into ``S`` K ranges on one cluster, ``S`` as large as
    ``SPLIT_SWAPPED_MAX_CTAS`` CTAs allow (and ``ctas``, the resident CTAs or their
    override; at most ``CLUSTER_MAX_SPLITS``, the k-tiles, and what is resident at once),
    planned for ``SPLIT_SWAPPED_MIN_TOKENS <= T <= SWAP_MAX_TOKENS`` when that gives at least
    ``SPLIT_SWAPPED_MIN_SPLITS`` splits; up to ``SPLIT_SWAPPED_SWAP16_MAX_TOKENS``, on at most
    ``SPLIT_SWAPPED_SWAP16_MAX_CTAS`` CTAs, the mma core's split swapped plan instead where
    all its CTAs fit at once (twice the CTAs; None where they do not). With fewer splits, one
    CTA a tile up to ``UNSPLIT_SWAPPED_MAX_TOKENS`` where the tiles are one token tile or at
    least ``UNSPLIT_SWAPPED_MIN_SHARE`` of ``SPLIT_SWAPPED_MAX_CTAS``. So the split plan runs
    for the layouts of at most 26 weight tiles per token tile, where the other plans leave most
    SMs idle; measured against the plan before it (H200, 2026-12-02 20:00 UTC, cold us): TP 8,
    T = 64, 13.1 against 14.3; D = 64 (H 4096, L 3, n_kv 4), T = 64, 13.3 against 14.6; H
    2048 x 1 x 1 x 128, T = 64 / 128 / 256, 8.4 / 8.7 / 9.9 against 10.7 / 10.6 / 10.8; and
    at T = 17..32 (2026-12-05) as at ``SPLIT_SWAPPED_MIN_TOKENS``. At T <= 16 the mma core's
    split plan measured faster in every layout (TP 8, T = 1: 10.2 against 10.9)."""
    config = TILES[SPLIT_SWAPPED_WGMMA_TILES[0]]
    if (not SPLIT_SWAPPED_MIN_TOKENS <= tokens <= SWAP_MAX_TOKENS
            or config.columns(layout.head_dim, layout.kv) > SWAPPED_WGMMA_MAX_COLUMNS):
        return None
    tiles = tile_count(tokens, layout, config)
    most_ctas = min(SPLIT_SWAPPED_MAX_CTAS, ctas)
    splits = min(CLUSTER_MAX_SPLITS, hidden // STACKED_K_TILE, most_ctas // tiles)
    while splits > 1 and tiles * splits > residency(splits, 1):
        splits -= 1
    if splits >= SPLIT_SWAPPED_MIN_SPLITS:
        if (tokens <= SPLIT_SWAPPED_SWAP16_MAX_TOKENS
                and tiles * splits <= SPLIT_SWAPPED_SWAP16_MAX_CTAS):
            swap16, estimate_us = swap_plan(layout, tokens, hidden, ctas, residency)
            return swap16 if estimate_us < math.inf else None
        return StackedPlan(StackedVariant("wgmma", config.name, True), False, tiles * splits,
                           tiles, splits)
    one_token_tile = tokens <= config.bm
    if not (tiles <= most_ctas and tokens <= UNSPLIT_SWAPPED_MAX_TOKENS
            and (one_token_tile or tiles >= UNSPLIT_SWAPPED_MIN_SHARE * most_ctas)):
        return None
    return StackedPlan(StackedVariant("wgmma", config.name), False, tiles, tiles)


def wgmma_dp_estimate_us(layout: StackedLayout, tokens: int, hidden: int, ctas: int,
                         tile: str) -> float:
    """Estimated cold time of the wgmma core's data-parallel plan with ``tile``."""
    config = TILES[tile]
    bn = config.columns(layout.head_dim, layout.kv)
    waves = -(-tile_count(tokens, layout, config) // ctas)
    return wgmma_estimate_us(layout.weight_bytes(hidden), waves * bn * hidden * 2,
                             waves * 2 * config.bm * bn * hidden)


def choose_plan(layout: StackedLayout, tokens: int, hidden: int, ctas: int,
                residency: ClusterResidency | None = None) -> StackedPlan:
    """The plan of a call of ``tokens`` rows and hidden size ``hidden`` on a GPU that holds
    ``ctas`` CTAs of the wgmma core at once (one per SM) and ``residency`` CTAs of the mma
    core in clusters (default: :func:`formula_residency`).

    On the wgmma core, the plan :func:`decode_swapped_plan` gives, where it gives one (no
    override set, a forced split included): sw32 split along K or one CTA a tile, or the mma
    core's swapped tile where sw32 would stream on too few CTAs. Else, up
    to ``SWAP_MAX_TOKENS``, the mma core's split swapped tile when all its CTAs fit at once
    and, where the wgmma core exists, its estimated time is below the wgmma core's (the cost
    model above). Otherwise the
    data-parallel tile of least estimated waves, or stream-K where it measured faster
    (``STREAM_K_*``). Overrides: ``CUTE_KERNELS_STACKED_{IMPL,TILE,SCHEDULE,
    CTAS,SPLITS}``; any but the split one leaves the swapped tile out unless it names it. The
    mma core has no stream-K schedule: one CTA per tile, or per k-range of a split tile."""
    impl = choose_impl(layout.arch)
    if residency is None:
        residency = formula_residency(ctas)
    cap = ctas_cap()
    ctas = ctas if cap is None else min(ctas, cap)
    overridden = any(os.environ.get(name, "auto") != "auto"
                     for name in (IMPL_ENV, TILE_ENV, SCHEDULE_ENV))
    wanted = forced_schedule()
    if not overridden and impl == "wgmma" and forced_splits() is None:
        plan = decode_swapped_plan(layout, tokens, hidden, ctas, residency)
        if plan is not None:
            return plan
    # a forced stream-K schedule takes a whole-head tile (the split-head plan is data-parallel)
    tile = choose_tile(tokens, impl, layout.num_layers, layout.n_kv, layout.head_dim, ctas,
                       data_parallel=wanted != "streamk", hidden=hidden)
    if not overridden and tokens <= SWAP_MAX_TOKENS:
        plan, estimate_us = swap_plan(layout, tokens, hidden, ctas, residency)
        # no other core to weigh it against on an arch without wgmma: taken when it fits
        other_us = (wgmma_dp_estimate_us(layout, tokens, hidden, ctas, tile)
                    if impl == "wgmma" else math.inf)
        if estimate_us < other_us:
            return plan
    config = TILES[tile]
    tiles = tile_count(tokens, layout, config)
    if impl == "mma":
        return split_plan(layout, tile, tokens, hidden, ctas, residency, forced_handover())
    if config.persistent:  # one CTA per SM, tiles in turn
        return StackedPlan(StackedVariant(impl, tile), False, min(tiles, ctas), tiles)
    if config.tokens_n:  # one CTA per tile or split (check_overrides: never stream-K)
        splits = min(forced_splits() or 1, hidden // STACKED_K_TILE)
        return StackedPlan(StackedVariant(impl, tile, splits > 1), False, tiles * splits, tiles,
                           splits)
    if config.split_head:  # data-parallel (check_overrides), on whole 2-CTA clusters
        # an even grid keeps a head's two halves in one cluster; no more clusters than are
        # resident at once (a cluster cannot span GPCs), so none waits for a second wave
        grid = max(2, min(tiles, ctas - ctas % 2, residency(2, 1)))
        return StackedPlan(StackedVariant(impl, tile), False, grid, tiles)
    tile_bytes = layout.weight_bytes(hidden) // tiles
    stream_k = wanted == "streamk" or (
        wanted == "auto" and tokens <= STREAM_K_MAX_TOKENS
        and tile_bytes >= STREAM_K_MIN_TILE_BYTES)
    if stream_k and wanted == "auto":
        tile = STREAM_K_TILE
        tiles = tile_count(tokens, layout, TILES[tile])
    grid, dp_tiles = schedule(tiles, hidden // STACKED_K_TILE, ctas, stream_k)
    return StackedPlan(StackedVariant(impl, tile), stream_k, grid, dp_tiles)


def variants_for(arch: str, head_dim: int | None = None,
                 kv: int | None = None) -> list[StackedVariant]:
    """Every variant a layout (of ``head_dim`` and ``kv = n_kv * D``, when given) can need on
    ``arch`` (what :func:`cute_kernels.precompile` builds): no swapped wgmma tile for D = 256,
    no wide swapped tile where kv holds no 256 columns (it would be the narrow one)."""
    def fits(tile: str) -> bool:
        config = TILES[tile]
        if not config.tokens_n or head_dim is None:
            return True
        if config.wide and kv is not None and not wide_tile_differs(head_dim, kv):
            return False
        return head_dim <= SWAPPED_WGMMA_MAX_COLUMNS

    split_swapped = [StackedVariant("wgmma", tile, True) for tile in SPLIT_SWAPPED_WGMMA_TILES
                     if "wgmma" in impls_for(arch) and fits(tile)]
    return ([StackedVariant(impl, tile) for impl in impls_for(arch) for tile in tiles_for(impl)
             if fits(tile)] + [StackedVariant("mma", tile, True) for tile in SWAP_TILES]
            + split_swapped)

