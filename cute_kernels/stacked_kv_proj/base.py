"""Shared base of the stacked KV projection GEMM cores: static configuration, the tile raster,
where a tile's rows go, and the epilogue arithmetic with its pinned rounding points R1..R3
(specs/stacked_kv_proj.md)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .. import dsl_utils as du
from .plan import EVICT_FIRST_WEIGHT_BYTES, TileConfig

BK = 64  # k-tile: one 128-byte swizzle atom of bf16 per row (layouts.STACKED_K_TILE)


def r1(acc: Float32, bias: Float32 | None) -> Float32:
    """R1: ``bf16(acc + b)``."""
    return du.round_to_bf16(acc if bias is None else du.add_rn(acc, bias))


def r2(y: Float32, rstd: Float32, weight: Float32) -> Float32:
    """R2: ``bf16((y * rstd) * w)``, each product rounded on its own (as PyTorch's)."""
    return du.round_to_bf16(du.mul_rn(du.mul_rn(y, rstd), weight))


def neox_rotate(x1: Float32, x2: Float32, cos: Float32, sin: Float32) -> tuple:
    """NeoX RoPE of the pair (d, d + D/2) in fp32, products and sums rounded one by one (the
    bf16 rounding R3 happens at the store)."""
    return (du.sub_rn(du.mul_rn(x1, cos), du.mul_rn(x2, sin)),
            du.add_rn(du.mul_rn(x2, cos), du.mul_rn(x1, sin)))


class StackedKvProjBase:
    """Static configuration, the tile raster and the destination of a tile's rows, shared by
    both GEMM cores."""

    def __init__(
        self,
        num_layers: int,
        n_kv: int,
        head_dim: int,
        has_bias: bool,
        has_commit: bool,
        norm_dtype: type,
        tile: TileConfig,
        threads: int,
    ) -> None:
        self.num_layers = num_layers
        self.n_kv = n_kv
        self.head_dim = head_dim
        self.kv = n_kv * head_dim
        self.n_total = num_layers * 2 * self.kv
        self.has_bias = has_bias
        self.has_commit = has_commit
        self.norm_dtype = norm_dtype
        self.bm, self.bk = tile.bm, BK
        self.bn = tile.columns(head_dim, self.kv)
        self.split_head = tile.split_head
        # columns of one head in a tile: all of it, or the half of a split-head tile
        self.head_cols = head_dim // 2 if tile.split_head else head_dim
        self.threads = threads
        self.num_n_tiles = self.n_total // self.bn
        self.heads_per_tile = self.bn // self.head_cols
        # CTA raster: 8 M tiles share each weight tile while it is in L2 (16 and 32 measured
        # no faster at T = 8192)
        self.group_m = 8

    def ring_stages(self, cap: int, budget: int) -> int:
        """A/B ring depth: ``cap`` stages, fewer if the budget holds fewer."""
        return max(2, min(cap, budget // ((self.bm + self.bn) * self.bk * 2)))

    def weight_evict_first(self, hidden: Int32) -> cutlass.Boolean:
        """Whether the weight's loads carry the L2 evict_first policy
        (``dsl_utils.evict_first_policy``): from :data:`~.plan.EVICT_FIRST_WEIGHT_BYTES` of
        weight (``n_total x hidden`` bf16)."""
        return Int64(self.n_total * 2) * Int64(hidden) >= Int64(EVICT_FIRST_WEIGHT_BYTES)

    @cute.jit
    def arrive(self, counter: Int64, count: Int32, sArrived: cute.Tensor, tid: Int32,
               barrier_id: int | None = None, threads: int | None = None) -> cutlass.Boolean:
        """After the calling threads' stores of a partial (the CTA's, or with ``barrier_id``
        the ``threads`` threads of that named barrier): count it as arrived at the tile's
        ``counter`` and return, on every calling thread, whether it completed ``count``
        arrivals. One thread adds 1 after a CTA barrier (``fence.acq_rel.gpu`` + a relaxed
        atomic: a release whose cumulativity carries the others' stores) and fences again
        (acquire: the other partials are visible to all after the second barrier); the last
        zeroes the counter (every partial has arrived), so the next launch — a CUDA-graph
        replay included — starts from zero. ``sArrived``: one Int32 of shared memory."""
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if tid == 0:
            arrived = du.atomic_add_release(counter, Int32(1))
            du.fence_acq_rel()
            if arrived == count - 1:
                du.store_relaxed(counter, Int32(0))
            sArrived[0] = arrived
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        return sArrived[0] == count - 1

    @cute.jit
    def tile_coords(self, tile: Int32, num_m_tiles: Int32) -> tuple:
        """Grouped raster: ``group_m`` M tiles run next to each other on each weight tile.
        Split-head tiles: the two halves of a head are consecutive tiles (the two CTAs of a
        cluster, with an even grid), the raster runs over the heads."""
        if const_expr(self.split_head):
            tile_m, head = self.grouped_coords(tile // 2, num_m_tiles, self.num_n_tiles // 2)
            return tile_m, 2 * head + tile % 2
        return self.grouped_coords(tile, num_m_tiles, self.num_n_tiles)

    @cute.jit
    def grouped_coords(self, tile: Int32, num_m_tiles: Int32, num_n_tiles: int) -> tuple:
        """(M tile, N tile) of ``tile`` in the grouped raster over ``num_n_tiles``."""
        per_group = self.group_m * num_n_tiles
        group = tile // per_group
        first_m = group * self.group_m
        group_rows = cutlass.min(num_m_tiles - first_m, self.group_m)
        in_group = tile - group * per_group
        tile_m = first_m + in_group % group_rows
        tile_n = in_group // group_rows
        return tile_m, tile_n

    @cute.jit
    def cache_row_base(self, caches: tuple, layer: Int32) -> tuple:
        """(base address, row stride in bytes, slot count) of ``caches[layer]``: a select
        chain over the L tensor arguments (CTA-uniform)."""
        base = Int64(0)
        stride = Int64(0)
        slots = Int64(0)
        for i in cutlass.range_constexpr(self.num_layers):
            base = cutlass.select_(layer == i, caches[i].iterator.toint(), base)
            stride = cutlass.select_(layer == i, Int64(caches[i].stride[0]) * 2, stride)
            slots = cutlass.select_(layer == i, Int64(caches[i].shape[0]), slots)
        return base, stride, slots

    @cute.jit
    def tile_layer(self, tile_n: Int32) -> tuple:
        """(layer, first stacked column within the layer) of weight tile ``tile_n`` (of its
        head, for a split-head tile): the tile is K when that column is below ``kv``."""
        n0 = (tile_n // 2) * self.head_dim if self.split_head else tile_n * self.bn
        layer = n0 // (2 * self.kv)
        return layer, n0 - layer * (2 * self.kv)

    @cute.jit
    def tile_destination(self, tile_n: Int32, k_caches: tuple, v_caches: tuple,
                         tile_col: Int32) -> tuple:
        """Where column ``tile_col`` of weight tile ``tile_n`` goes: (layer, is K, byte address
        of that column in cache row 0, cache row stride in bytes, the cache's slot count). A
        tile lies in one layer's K or V block (``bn | kv``), so all of it is CTA-uniform but
        ``tile_col``."""
        layer, in_layer = self.tile_layer(tile_n)
        is_v = in_layer >= self.kv
        col0 = in_layer - cutlass.select_(is_v, Int32(self.kv), Int32(0))  # column in K or V
        k_base, k_stride, k_slots = self.cache_row_base(k_caches, layer)
        v_base, v_stride, v_slots = self.cache_row_base(v_caches, layer)
        base = cutlass.select_(is_v, v_base, k_base) + Int64(col0 + tile_col) * 2
        return (layer, in_layer < self.kv, base, cutlass.select_(is_v, v_stride, k_stride),
                cutlass.select_(is_v, v_slots, k_slots))

    @cute.jit
    def token_slots(self, mLoc: cute.Tensor) -> cute.Tensor:
        """The cache slot of each of the T rows: ``cache_loc``, or ``cache_loc_2d`` ``[bs, W]``
        (contiguous, validated) read as ``[bs * W]``, as it comes (no flat view per call)."""
        if const_expr(self.has_commit):
            return cute.make_tensor(mLoc.iterator,
                                    cute.make_layout((mLoc.shape[0] * mLoc.shape[1],)))
        return mLoc

    @cute.jit
    def row_destination(self, mLoc: cute.Tensor, mCommit: cute.Tensor | None, width: Int32,
                        token: Int32) -> tuple:
        """(token clamped into range, cache slot, whether the row is written): a row is written
        when it is a real token, its slot is not negative and, with ``cache_loc_2d``, its
        column is below its request's ``commit_lens``."""
        in_range = token < mLoc.shape[0]
        t = cutlass.select_(in_range, token, Int32(0))
        slot = mLoc[t]
        valid = in_range & (slot >= 0)
        if const_expr(self.has_commit):
            req = t // width
            valid = valid & ((t - req * width) < mCommit[req])
        return t, slot, valid
