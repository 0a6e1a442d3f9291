"""Planning of a stacked KV projection call, apart from its validation and with no DSL import:
which GEMM core, which CTA tile, for a validated layout, a token count and an SM count.

A plan only picks among compiled variants (``StackedKvProjKey`` holds the layout and the plan),
so one compile per (layout, plan) serves every token count.
"""

from __future__ import annotations

import dataclasses
import os

from ..validation import fail

#: ``auto`` (default: wgmma on sm_90a, mma elsewhere), ``mma`` or ``wgmma`` (sm_90a only).
IMPL_ENV = "CUTE_KERNELS_STACKED_IMPL"
#: ``auto`` (default: by T, see :func:`choose_tile`) or a TILES name, to compare tiles.
TILE_ENV = "CUTE_KERNELS_STACKED_TILE"


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A CTA tile: ``bm`` tokens x ``bn`` stacked columns, ``bn`` from :func:`tile_n`."""

    name: str
    bm: int  # tokens per CTA tile
    wide: bool  # 256-column tiles where kv allows (two D = 128 heads: m64n256 wgmma)
    mma_stages: int  # cp.async ring depth cap of the mma core (the wgmma ring fills its budget)
    cost: float  # time of one tile relative to m128, measured (see choose_tile)


# Small T is weight-bandwidth bound: m64 keeps the most bytes in flight per weight tile (80
# CTAs for N = 10240). Larger T is math bound: 128-row tiles, and on the wgmma core 128 x 256
# (two consumer warpgroups of m64n256, the shape with the least SMEM and L2 operand traffic
# per MMA). Costs: H200, 2026-11-29, cold, H 4096, L 5, n_kv 8, D 128 (specs/stacked_kv_proj.md):
# m64 streams a weight tile in 0.85 of m128's time at T = 64; m128w does twice m128's work in
# 1.75 of its time at T >= 1024.
TILE_SMALL = TileConfig("m64", bm=64, wide=False, mma_stages=8, cost=0.85)
TILE_MEDIUM = TileConfig("m128", bm=128, wide=False, mma_stages=4, cost=1.0)
TILE_WIDE = TileConfig("m128w", bm=128, wide=True, mma_stages=0, cost=1.75)
TILES = {t.name: t for t in (TILE_SMALL, TILE_MEDIUM, TILE_WIDE)}


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


@dataclasses.dataclass(frozen=True)
class StackedPlan:
    impl: str  # "wgmma" (TMA + wgmma, sm_90a only) | "mma" (cp.async + mma.sync, every arch)
    tile: str  # a TILES name


def tiles_for(impl: str) -> tuple[str, ...]:
    """Tile configs a core compiles: the mma core has no wide tile (its SMEM-staged epilogue
    would need 135 KiB of fp32 C for 128 x 256)."""
    return tuple(name for name, t in TILES.items() if impl == "wgmma" or not t.wide)


def tile_n(head_dim: int, kv: int, wide: bool = False) -> int:
    """Columns per CTA tile: a multiple of D that divides kv (so a tile never straddles the
    K/V boundary or a layer), 128 (256 for a wide tile) when possible."""
    if wide and kv % 256 == 0:
        return 256
    bn = max(head_dim, 128)
    return bn if kv % bn == 0 else head_dim


def impls_for(arch: str) -> tuple[str, ...]:
    """GEMM cores that compile for ``arch``: wgmma exists on sm_90a only."""
    return ("wgmma", "mma") if arch == "sm_90a" else ("mma",)


def choose_impl(arch: str) -> str:
    """The core a call uses on ``arch`` (``CUTE_KERNELS_STACKED_IMPL`` overrides)."""
    wanted = os.environ.get(IMPL_ENV, "auto")
    if wanted == "auto":
        return impls_for(arch)[0]
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


def check_overrides(arch: str) -> None:
    """Raise :class:`LayoutError` for an override the calls on ``arch`` would reject."""
    forced_tile(choose_impl(arch))


def choose_tile(tokens: int, impl: str, num_layers: int, n_kv: int, head_dim: int,
                sms: int) -> str:
    """The tile config for ``tokens`` rows of a layout on core ``impl`` with ``sms`` SMs
    (``CUTE_KERNELS_STACKED_TILE`` overrides): the least ``waves x cost``, a wave being one
    tile per SM and ``cost`` a tile's measured time relative to m128. The wave count is what
    makes m128 beat m128w at T = 512..1024 on the drafter layout (3 and 5 waves against 2 and
    3 of 1.75) and m64 lose to m128 at T = 128 (two waves of 64-row tiles, one of 128)."""
    forced = forced_tile(impl)
    if forced is not None:
        return forced
    kv = n_kv * head_dim

    def estimate(name: str) -> float:
        tile = TILES[name]
        tiles = -(-tokens // tile.bm) * (num_layers * 2 * kv // tile_n(head_dim, kv, tile.wide))
        return -(-tiles // sms) * tile.cost

    return min(tiles_for(impl), key=estimate)


def choose_plan(layout: StackedLayout, tokens: int, sms: int) -> StackedPlan:
    """The plan of a call of ``tokens`` rows on a GPU with ``sms`` SMs."""
    impl = choose_impl(layout.arch)
    return StackedPlan(impl, choose_tile(tokens, impl, layout.num_layers, layout.n_kv,
                                         layout.head_dim, sms))


def plans_for(arch: str) -> list[StackedPlan]:
    """Every plan a layout can get on ``arch`` (what :func:`cute_kernels.precompile` builds)."""
    return [StackedPlan(impl, tile) for impl in impls_for(arch) for tile in tiles_for(impl)]
