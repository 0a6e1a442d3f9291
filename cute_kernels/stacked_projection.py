"""DSpark stacked context-KV projection: one GEMM for every layer's K and V, with a fused
per-head RMSNorm + NeoX RoPE epilogue that scatters rows straight into per-layer KV caches.

``ctx_hidden [T, H] @ weight[L*2*kv, H]^T (+ bias)``; for stacked column ``n`` of layer ``l``:
``y = bf16(acc + b)`` (R1); K heads ``bf16((y * rsqrt(sum y^2 / D + eps)) * w_l)`` (R2) then NeoX
RoPE in fp32 and bf16 (R3); V heads ``y``. Row ``t`` lands in slot ``cache_loc[t]`` (or
``cache_loc_2d.flatten()[t]``) of ``k_caches[l]`` / ``v_caches[l]``. Contract:
specs/stacked_kv_proj.md.

Two GEMM cores, one contract. A CTA tile is ``BM`` tokens x ``BN`` stacked columns with
``D | BN | kv``, so it lies in one layer's K or V block and owns whole heads.

- sm_90a: a persistent, warp-specialised TMA + warpgroup ``wgmma`` GEMM whose epilogue works on
  the accumulator registers (:class:`StackedKvProjWgmma`).
- every arch (sm_100a, and the sm_90a fallback): ``cp.async`` + warp ``mma.sync``, one tile per
  CTA, the accumulators staged through SMEM for the epilogue (:class:`StackedKvProjMma`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr

from . import dsl_utils as du
from .arch import SUPPORTED_ARCHS, arch_for, max_active_clusters
from .compile_cache import KernelCache
from .ops import mutating_op
from .validation import (
    LayoutError,
    expect_base_aligned,
    expect_contiguous,
    expect_dtype,
    expect_rank,
    expect_same_device,
    expect_tensor,
    fail,
)

HEAD_DIMS = (64, 128, 256)
VECTOR_BYTES = 16  # every global access of the mma epilogue and every cp.async is 16 bytes
MAX_LAYERS = 16  # the caches are kernel arguments: one pointer + stride per layer and per K/V
CHUNK = 8  # columns per thread per half head in the mma epilogue (one 16-byte bf16 vector)
SMEM_BUDGET = 200 * 1024  # bytes of A/B ring per CTA (227 KiB is the sm_90/sm_100 maximum)
WGMMA_SMEM_BUDGET = 224 * 1024  # the TMA ring adds only its mbarriers
# setmaxnreg split of the wgmma core's 64 K registers: the TMA warpgroup needs a handful, the
# MMA warpgroups hold up to 128 fp32 accumulators each (m64n256) plus the epilogue's operands.
PRODUCER_REGS = 40
CONSUMER_REGS = 232


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
IMPLS = {"mma": None, "wgmma": None}  # filled below with the kernel classes
#: ``auto`` (default: wgmma on sm_90a, mma elsewhere), ``mma`` or ``wgmma`` (sm_90a only).
IMPL_ENV = "CUTE_KERNELS_STACKED_IMPL"
#: ``auto`` (default: by T, see :func:`choose_tile`) or a TILES name, to compare tiles.
TILE_ENV = "CUTE_KERNELS_STACKED_TILE"


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


@dataclasses.dataclass(frozen=True)
class StackedKvProjKey:
    """Everything that changes the generated code. T, H, the slot counts, the cos/sin table
    length, the cache row strides, W and eps are runtime values."""

    num_layers: int
    n_kv: int
    head_dim: int
    has_bias: bool
    has_commit: bool
    norm_dtype: str  # "float32" | "bfloat16"
    tile: str  # a TILES name
    impl: str  # "wgmma" (TMA + wgmma, sm_90a only) | "mma" (cp.async + mma.sync, every arch)
    arch: str


def _rsqrt_approx(x: Float32) -> Float32:
    """``rsqrt.approx.f32``: what CUDA's ``rsqrtf`` (torch.rsqrt on a GPU) and flashinfer's
    RMSNorm use."""
    return cute.arch.inline_ptx(
        "rsqrt.approx.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x]
    )


def _sub_rn(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx(
        "sub.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def _add_rn(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx(
        "add.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def _r1(acc: Float32, bias: Float32 | None) -> Float32:
    """R1: ``bf16(acc + b)``."""
    return du.round_to_bf16(acc if bias is None else _add_rn(acc, bias))


def _r2(y: Float32, rstd: Float32, weight: Float32) -> Float32:
    """R2: ``bf16((y * rstd) * w)``, each product rounded on its own (as PyTorch's)."""
    return du.round_to_bf16(du.mul_rn(du.mul_rn(y, rstd), weight))


def _neox_rotate(x1: Float32, x2: Float32, cos: Float32, sin: Float32) -> tuple:
    """NeoX RoPE of the pair (d, d + D/2) in fp32, products and sums rounded one by one (the
    bf16 rounding R3 happens at the store)."""
    return (_sub_rn(du.mul_rn(x1, cos), du.mul_rn(x2, sin)),
            _add_rn(du.mul_rn(x2, cos), du.mul_rn(x1, sin)))


class _StackedKvProjBase:
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
        self.bm, self.bk = tile.bm, 64  # bk: one 128-byte swizzle atom of bf16 per row
        self.bn = tile_n(head_dim, self.kv, tile.wide)
        self.threads = threads
        self.num_n_tiles = self.n_total // self.bn
        self.heads_per_tile = self.bn // head_dim
        # CTA raster: 8 M tiles share each weight tile while it is in L2 (16 and 32 measured
        # no faster at T = 8192)
        self.group_m = 8

    def ring_stages(self, cap: int, budget: int) -> int:
        """A/B ring depth: ``cap`` stages, fewer if the budget holds fewer."""
        return max(2, min(cap, budget // ((self.bm + self.bn) * self.bk * 2)))

    @cute.jit
    def tile_coords(self, tile: Int32, num_m_tiles: Int32) -> tuple:
        """Grouped raster: ``group_m`` M tiles run next to each other on each weight tile."""
        per_group = self.group_m * self.num_n_tiles
        group = tile // per_group
        first_m = group * self.group_m
        group_rows = cutlass.min(num_m_tiles - first_m, self.group_m)
        in_group = tile - group * per_group
        tile_m = first_m + in_group % group_rows
        tile_n = in_group // group_rows
        return tile_m, tile_n

    @cute.jit
    def cache_row_base(self, caches: tuple, layer: Int32) -> tuple:
        """(base address, row stride in bytes) of ``caches[layer]``: a select chain over the
        L tensor arguments (CTA-uniform)."""
        base = Int64(0)
        stride = Int64(0)
        for i in cutlass.range_constexpr(self.num_layers):
            base = cutlass.select_(layer == i, caches[i].iterator.toint(), base)
            stride = cutlass.select_(layer == i, Int64(caches[i].stride[0]) * 2, stride)
        return base, stride

    @cute.jit
    def tile_destination(self, tile_n: Int32, k_caches: tuple, v_caches: tuple,
                         tile_col: Int32) -> tuple:
        """Where column ``tile_col`` of weight tile ``tile_n`` goes: (layer, is K, byte address
        of that column in cache row 0, cache row stride in bytes). A tile lies in one layer's
        K or V block (``bn | kv``), so all of it is CTA-uniform but ``tile_col``."""
        n0 = tile_n * self.bn
        layer = n0 // (2 * self.kv)
        in_layer = n0 - layer * (2 * self.kv)
        is_v = in_layer >= self.kv
        col0 = in_layer - cutlass.select_(is_v, Int32(self.kv), Int32(0))  # column in K or V
        k_base, k_stride = self.cache_row_base(k_caches, layer)
        v_base, v_stride = self.cache_row_base(v_caches, layer)
        base = cutlass.select_(is_v, v_base, k_base) + Int64(col0 + tile_col) * 2
        return layer, in_layer < self.kv, base, cutlass.select_(is_v, v_stride, k_stride)

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


class StackedKvProjMma(_StackedKvProjBase):
    """Portable ``mma.sync`` GEMM + norm/RoPE/scatter epilogue (runs on sm_80 and later).

    The fp32 accumulators go through SMEM; a second thread mapping then gives each thread 8
    columns of one head's first half and the 8 NeoX partners ``d + D/2`` of one row, so the
    pair is register-local, the sum of squares is an in-thread sum plus a butterfly over the
    ``D / 16`` threads of the head, and each half leaves as one 16-byte store."""

    def __init__(self, num_layers: int, n_kv: int, head_dim: int, has_bias: bool,
                 has_commit: bool, norm_dtype: type, tile: TileConfig) -> None:
        assert not tile.wide, "the mma core has no wide tile"
        self.warps_m, self.warps_n = 2, tile.bm // 32
        super().__init__(num_layers, n_kv, head_dim, has_bias, has_commit, norm_dtype, tile,
                         32 * self.warps_m * self.warps_n)
        self.stages = self.ring_stages(tile.mma_stages, SMEM_BUDGET)
        assert self.bm % (16 * self.warps_m) == 0 and self.bn % (16 * self.warps_n) == 0
        # Epilogue thread mapping: lanes_per_head threads per (row, head), heads of the tile
        # next, rows last; each thread keeps its columns for every row it handles.
        self.lanes_per_head = head_dim // (2 * CHUNK)
        self.row_step = self.threads // (self.lanes_per_head * self.heads_per_tile)
        assert self.row_step >= 1 and self.bm % self.row_step == 0
        self.c_stride = self.bn + 8  # fp32 staging row, padded: 2 wavefronts per 64-bit store
        stage_bytes = (self.bm + self.bn) * self.bk * 2
        assert self.bm * self.c_stride * 4 <= self.stages * stage_bytes, "C reuses the A/B ring"

    # -- host side -------------------------------------------------------------------------

    def _smem_layout_ab(self, rows: int) -> cute.ComposedLayout:
        """K-major ``(rows, bk, stages)`` ring, XOR-swizzled so ldmatrix is conflict-free."""
        width = min(self.bk, 64)
        swizzle_bits = int(math.log2(width * 16 // 128))
        atom = cute.make_composed_layout(
            cute.make_swizzle(min(swizzle_bits, 3), 3, 3),
            0,
            cute.make_layout((8, width), stride=(width, 1)),
        )
        return cute.tile_to_shape(atom, (rows, self.bk, self.stages), (0, 1, 2))

    def _gmem_copy(self, atom: cute.CopyAtom) -> cute.TiledCopy:
        per_row = self.bk // CHUNK
        threads = cute.make_layout((self.threads // per_row, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, CHUNK)))

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mLoc: cute.Tensor,
        mCommit: cute.Tensor | None,
        width: Int32,
        k_caches: tuple,
        v_caches: tuple,
        stream: cuda.CUstream,
    ) -> None:
        sA_layout = self._smem_layout_ab(self.bm)
        sB_layout = self._smem_layout_ab(self.bn)
        g2s = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            BFloat16,
            num_bits_per_copy=128,
        )
        copy_a = self._gmem_copy(g2s)
        copy_b = self._gmem_copy(g2s)
        mma_op = cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(
            mma_op,
            cute.make_layout((self.warps_m, self.warps_n, 1)),
            permutation_mnk=(16 * self.warps_m, 16 * self.warps_n, 16),
        )
        num_m_tiles = cute.ceil_div(mX.shape[0], self.bm)
        self.kernel(
            mX, mW, mBias, mNormW, eps, mPos, mCosSin, mLoc, mCommit, width, k_caches, v_caches,
            sA_layout, sB_layout, copy_a, copy_b, tiled_mma,
        ).launch(
            grid=[num_m_tiles * self.num_n_tiles, 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    # -- device side -----------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mLoc: cute.Tensor,
        mCommit: cute.Tensor | None,
        width: Int32,
        k_caches: tuple,
        v_caches: tuple,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
    ) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        num_tokens = mX.shape[0]
        num_m_tiles = cute.ceil_div(num_tokens, self.bm)
        tile_m, tile_n = self.tile_coords(bid, num_m_tiles)

        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(BFloat16, sA_layout, 1024)
        sB = smem.allocate_tensor(BFloat16, sB_layout, 1024)

        tCrC = self.mainloop(mX, mW, sA, sB, copy_a, copy_b, tiled_mma, tile_m, tile_n, tidx)

        # fp32 accumulators -> padded SMEM tile (reusing the ring), then the epilogue mapping.
        c_layout = cute.make_layout((self.bm, self.bn), stride=(self.c_stride, 1))
        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, dtype=Float32), c_layout)
        thr_mma = tiled_mma.get_slice(tidx)
        cute.autovec_copy(tCrC, thr_mma.partition_C(sC))
        cute.arch.sync_threads()
        self.epilogue(
            sC, mBias, mNormW, eps, mPos, mCosSin, mLoc, mCommit, width, k_caches, v_caches,
            tile_m, tile_n, tidx,
        )

    @cute.jit
    def mainloop(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        sA: cute.Tensor,
        sB: cute.Tensor,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        tile_m: Int32,
        tile_n: Int32,
        tidx: Int32,
    ) -> cute.Tensor:
        """``acc = X[tile_m] @ W[tile_n]^T`` over all of H; returns the fp32 fragment."""
        k_tiles = mX.shape[1] // self.bk
        gA = cute.local_tile(mX, (self.bm, self.bk), (tile_m, None))  # (bm, bk, k_tiles)
        gB = cute.local_tile(mW, (self.bn, self.bk), (tile_n, None))
        cA = cute.local_tile(cute.make_identity_tensor(mX.shape), (self.bm, self.bk),
                             (tile_m, None))
        thr_a = copy_a.get_slice(tidx)
        thr_b = copy_b.get_slice(tidx)
        tAgA, tAsA, tAcA = thr_a.partition_S(gA), thr_a.partition_D(sA), thr_a.partition_S(cA)
        tBgB, tBsB = thr_b.partition_S(gB), thr_b.partition_D(sB)

        # Token rows beyond T are never loaded (their SMEM rows hold stale data, which only
        # reaches accumulator rows that are never stored: the GEMM is row-independent).
        tApA = cute.make_rmem_tensor(
            cute.make_layout(
                (tAgA.shape[0][1], cute.size(tAgA, mode=[1]), cute.size(tAgA, mode=[2])),
                stride=(cute.size(tAgA, mode=[1]), 1, 0),
            ),
            cutlass.Boolean,
        )
        for v in cutlass.range_constexpr(tApA.shape[0]):
            for m in cutlass.range_constexpr(tApA.shape[1]):
                tApA[v, m, 0] = cute.elem_less(tAcA[(0, v), m, 0, 0][0], mX.shape[0])

        # Prologue: stages - 1 tiles in flight (fewer when H is short; every group committed).
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < k_tiles:
                cute.copy(copy_a, tAgA[None, None, None, s],
                          tAsA[None, None, None, s], pred=tApA)
                cute.copy(copy_b, tBgB[None, None, None, s],
                          tBsB[None, None, None, s])
            cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        tCrC = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.bm, self.bn)), Float32)
        tCrC.fill(0.0)

        s2r_a = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), BFloat16),
            tiled_mma,
        )
        s2r_b = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), BFloat16),
            tiled_mma,
        )
        thr_s2r_a = s2r_a.get_slice(tidx)
        thr_s2r_b = s2r_b.get_slice(tidx)
        tXsA = thr_s2r_a.partition_S(sA)
        tXrA = thr_s2r_a.retile(tCrA)
        tXsB = thr_s2r_b.partition_S(sB)
        tXrB = thr_s2r_b.retile(tCrB)
        k_blocks = cute.size(tCrA, mode=[2])

        read_stage = Int32(0)
        write_stage = Int32(self.stages - 1)
        next_tile = Int32(self.stages - 1)
        cute.arch.cp_async_wait_group(self.stages - 2)
        cute.arch.sync_threads()
        tXsA_p = tXsA[None, None, None, read_stage]
        tXsB_p = tXsB[None, None, None, read_stage]
        cute.copy(s2r_a, tXsA_p[None, None, 0], tXrA[None, None, 0])
        cute.copy(s2r_b, tXsB_p[None, None, 0], tXrB[None, None, 0])

        for _k_tile in range(k_tiles):
            for kb in cutlass.range_constexpr(k_blocks):
                if const_expr(kb == k_blocks - 1):
                    # The stage just consumed is free (everyone passed the barrier below on
                    # the previous tile); wait for the next one to land.
                    tXsA_p = tXsA[None, None, None, read_stage]
                    tXsB_p = tXsB[None, None, None, read_stage]
                    cute.arch.cp_async_wait_group(self.stages - 2)
                    cute.arch.sync_threads()
                kb_next = (kb + 1) % k_blocks
                cute.copy(s2r_a, tXsA_p[None, None, kb_next], tXrA[None, None, kb_next])
                cute.copy(s2r_b, tXsB_p[None, None, kb_next], tXrB[None, None, kb_next])
                if const_expr(kb == 0):
                    if next_tile < k_tiles:
                        cute.copy(copy_a, tAgA[None, None, None, next_tile],
                                  tAsA[None, None, None, write_stage], pred=tApA)
                        cute.copy(copy_b, tBgB[None, None, None, next_tile],
                                  tBsB[None, None, None, write_stage])
                    next_tile = next_tile + 1
                    cute.arch.cp_async_commit_group()
                    write_stage = read_stage
                    read_stage = read_stage + 1
                    if read_stage == self.stages:
                        read_stage = Int32(0)
                cute.gemm(tiled_mma, tCrC, tCrA[None, None, kb], tCrB[None, None, kb], tCrC)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # the ring is reused for the C staging tile
        return tCrC

    @cute.jit
    def epilogue(
        self,
        sC: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mLoc: cute.Tensor,
        mCommit: cute.Tensor | None,
        width: Int32,
        k_caches: tuple,
        v_caches: tuple,
        tile_m: Int32,
        tile_n: Int32,
        tidx: Int32,
    ) -> None:
        """Rows of the staged fp32 tile -> cache rows."""
        half = self.head_dim // 2
        lane_in_head = tidx % self.lanes_per_head
        head = (tidx // self.lanes_per_head) % self.heads_per_tile
        row_first = tidx // (self.lanes_per_head * self.heads_per_tile)
        col_lo = head * self.head_dim + lane_in_head * CHUNK  # tile column of the first half
        layer, is_k, base, row_bytes = self.tile_destination(tile_n, k_caches, v_caches, col_lo)

        # Per-thread constants: its 16 bias values and 16 norm weights (same for every row).
        rBias = cute.make_rmem_tensor((2 * CHUNK,), Float32)
        if const_expr(self.has_bias):
            rB16 = cute.make_rmem_tensor((CHUNK,), BFloat16)
            for h in cutlass.range_constexpr(2):
                gb = cute.local_tile(
                    mBias, (CHUNK,), ((tile_n * self.bn + col_lo + h * half) // CHUNK,)
                )
                cute.autovec_copy(gb, rB16)
                for i in cutlass.range_constexpr(CHUNK):
                    rBias[h * CHUNK + i] = rB16[i].to(Float32)
        rNorm = cute.make_rmem_tensor((2 * CHUNK,), Float32)
        rN = cute.make_rmem_tensor((CHUNK,), self.norm_dtype)
        d_lo = lane_in_head * CHUNK
        for h in cutlass.range_constexpr(2):
            gn = cute.local_tile(mNormW[layer, None], (CHUNK,), ((d_lo + h * half) // CHUNK,))
            cute.autovec_copy(gn, rN)
            for i in cutlass.range_constexpr(CHUNK):
                rNorm[h * CHUNK + i] = rN[i].to(Float32)

        inv_d = Float32(1.0 / self.head_dim)  # exact: D is a power of two
        rAcc = cute.make_rmem_tensor((CHUNK,), Float32)
        rY = cute.make_rmem_tensor((2 * CHUNK,), Float32)
        rCos = cute.make_rmem_tensor((CHUNK,), Float32)
        rSin = cute.make_rmem_tensor((CHUNK,), Float32)
        rOut = cute.make_rmem_tensor((CHUNK // 2,), Uint32)
        for it in cutlass.range_constexpr(self.bm // self.row_step):
            row = row_first + it * self.row_step
            t, slot, valid = self.row_destination(mLoc, mCommit, width, tile_m * self.bm + row)
            for h in cutlass.range_constexpr(2):
                col = (col_lo + h * half) // CHUNK
                cute.autovec_copy(cute.local_tile(sC[row, None], (CHUNK,), (col,)), rAcc)
                for i in cutlass.range_constexpr(CHUNK):
                    rY[h * CHUNK + i] = _r1(
                        rAcc[i], rBias[h * CHUNK + i] if const_expr(self.has_bias) else None
                    )

            if is_k:
                # Every lane of the warp is here (is_k is CTA-uniform): safe to shuffle.
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(2 * CHUNK):
                    ss = ss + rY[i] * rY[i]
                offset = 1
                for _ in cutlass.range_constexpr(int(math.log2(self.lanes_per_head))):
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=offset)
                    offset *= 2
                rstd = _rsqrt_approx(ss * inv_d + eps)
                for i in cutlass.range_constexpr(2 * CHUNK):
                    rY[i] = _r2(rY[i], rstd, rNorm[i])
                position = cutlass.select_(valid, mPos[t], Int64(0))
                gCS = mCosSin[position, None]
                cute.autovec_copy(cute.local_tile(gCS, (CHUNK,), (lane_in_head,)), rCos)
                cute.autovec_copy(
                    cute.local_tile(gCS, (CHUNK,), ((half + d_lo) // CHUNK,)), rSin
                )
                for i in cutlass.range_constexpr(CHUNK):
                    rY[i], rY[CHUNK + i] = _neox_rotate(rY[i], rY[CHUNK + i], rCos[i], rSin[i])

            if valid:
                row_addr = base + Int64(slot) * row_bytes
                for h in cutlass.range_constexpr(2):
                    for w in cutlass.range_constexpr(CHUNK // 2):
                        rOut[w] = du.pack_bf16x2(  # R3 (K) / exact (V)
                            rY[h * CHUNK + 2 * w], rY[h * CHUNK + 2 * w + 1]
                        )
                    du.store_words(row_addr + h * half * 2, rOut)


class StackedKvProjWgmma(_StackedKvProjBase):
    """sm_90a core: persistent and warp-specialised.

    Warpgroup 0 is the producer: one thread issues the TMA loads of A and B k-tiles into an
    mbarrier-guarded SMEM ring (``PipelineTmaAsync``), running ahead across tile boundaries, so
    the next tile's first stages land while the consumers run the epilogue. Warpgroups 1.. are
    consumers, one per 64 rows of the tile: ``wgmma`` m64nBNk16 from SMEM, one commit group in
    flight. ``setmaxnreg`` moves registers from the producer to the consumers. Rows of
    ``ctx_hidden`` beyond T are zero-filled by TMA. The CTAs stride over the tiles in the
    grouped raster order.

    The epilogue works on the accumulator registers, with no SMEM round trip. In the wgmma
    fragment, thread ``(warp w, lane l)`` of a consumer warpgroup holds rows ``16w + l/4`` and
    ``+8`` at columns ``8j + 2(l%4) + {0, 1}`` for every ``j``: a row of a head is spread over
    the 4 lanes of a quad, and the NeoX partner ``d + D/2`` of a column is in the same thread
    (D/2 is a multiple of 8). So the sum of squares is an in-thread sum plus two quad shuffles,
    RoPE is register-local, and each thread stores 4-byte pairs (a quad writes 16 contiguous
    bytes per ``j``; L2 merges the sectors of a cache row before they reach DRAM)."""

    def __init__(self, num_layers: int, n_kv: int, head_dim: int, has_bias: bool,
                 has_commit: bool, norm_dtype: type, tile: TileConfig) -> None:
        self.consumer_warpgroups = tile.bm // 64
        super().__init__(num_layers, n_kv, head_dim, has_bias, has_commit, norm_dtype, tile,
                         128 * (1 + self.consumer_warpgroups))
        self.stages = self.ring_stages(16, WGMMA_SMEM_BUDGET)
        assert self.bm in (64, 128) and self.bn in (64, 128, 256)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mLoc: cute.Tensor,
        mCommit: cute.Tensor | None,
        width: Int32,
        k_caches: tuple,
        v_caches: tuple,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ) -> None:
        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR  # both operands are [rows, H], H inner
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.bn),
        )
        tile_mnk = (self.bm, self.bn, self.bk)
        sA_layout = sm90_utils.make_smem_layout_a(k_major, tile_mnk, BFloat16, self.stages)
        sB_layout = sm90_utils.make_smem_layout_b(k_major, tile_mnk, BFloat16, self.stages)
        # DLPack may report stride 1 for a size-1 dim (T = 1); a TMA descriptor needs 16-byte
        # strides, and any stride >= H describes a single row equally well.
        row_stride = cutlass.max(mX.stride[0], Int64(mX.shape[1]))
        mX_rows = cute.make_tensor(mX.iterator, cute.make_layout(mX.shape, stride=(row_stride, 1)))
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mX_rows,
            cute.slice_(sA_layout, (None, None, 0)), (self.bm, self.bk),
        )
        tma_b, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mW,
            cute.slice_(sB_layout, (None, None, 0)), (self.bn, self.bk),
        )

        @cute.struct
        class SharedStorage:
            full_empty: cute.struct.MemRange[Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]

        self.shared_storage = SharedStorage
        num_tiles = cute.ceil_div(mX.shape[0], self.bm) * self.num_n_tiles
        self.kernel(
            tma_a, tma_mA, tma_b, tma_mW, mBias, mNormW, eps, mPos, mCosSin, mLoc, mCommit,
            width, k_caches, v_caches, sA_layout, sB_layout, tiled_mma,
        ).launch(
            grid=[cutlass.min(num_tiles, max_ctas), 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mLoc: cute.Tensor,
        mCommit: cute.Tensor | None,
        width: Int32,
        k_caches: tuple,
        v_caches: tuple,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
        num_m_tiles = cute.ceil_div(mLoc.shape[0], self.bm)
        num_tiles = num_m_tiles * self.num_n_tiles
        k_tiles = mA.shape[1] // self.bk

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        stage_bytes = cute.size_in_bytes(
            BFloat16, cute.slice_(sA_layout, (None, None, 0))
        ) + cute.size_in_bytes(BFloat16, cute.slice_(sB_layout, (None, None, 0)))
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.full_empty.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # one release per consumer warp
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 4 * self.consumer_warpgroups
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        gA = cute.local_tile(mA, (self.bm, self.bk), (None, None))  # (bm, bk, m tiles, k tiles)
        gB = cute.local_tile(mB, (self.bn, self.bk), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                producer = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                for tile in cutlass.range(bid, num_tiles, grid, unroll=1):
                    tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                    for k_tile in cutlass.range(k_tiles, unroll=1):
                        ring.producer_acquire(producer)
                        barrier = ring.producer_get_barrier(producer)
                        cute.copy(tma_a, tAgA[(None, tile_m, k_tile)],
                                  tAsA[(None, producer.index)], tma_bar_ptr=barrier)
                        cute.copy(tma_b, tBgB[(None, tile_n, k_tile)],
                                  tBsB[(None, producer.index)], tma_bar_ptr=barrier)
                        ring.producer_commit(producer)
                        producer.advance()
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128  # thread index among the consumers
            wg_mma = tiled_mma.get_slice(ctid - ctid % 128)
            tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.bm, self.bn)), Float32)
            # (row, column) in the tile of each accumulator register of this thread
            tCcC = tiled_mma.get_slice(ctid).partition_C(
                cute.make_identity_tensor((self.bm, self.bn))
            )
            k_blocks = cute.size(tCrA, mode=[2])
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            for tile in cutlass.range(bid, num_tiles, grid, unroll=1):
                tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                # The epilogue's row metadata (slot, then position: two dependent global
                # loads) is fetched now and lands while the main loop runs.
                rows = [self.row_destination(mLoc, mCommit, width,
                                             tile_m * self.bm + tCcC[2 * r][0])
                        for r in range(2)]
                positions = [cutlass.select_(valid, mPos[t], Int64(0)) for t, _, valid in rows]
                # Zeroed accumulators and a static ACCUMULATE flag: nothing loop-carried in
                # the MMA.
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                self.mma_stage(ring, read, tiled_mma, acc, tCrA, tCrB, k_blocks)  # k-tile 0
                read.advance()
                for _k_tile in cutlass.range(1, k_tiles, unroll=1):
                    self.mma_stage(ring, read, tiled_mma, acc, tCrA, tCrB, k_blocks)
                    # Keep one wgmma group in flight; the one before it has retired, so its
                    # stage goes back to the producer.
                    cute.nvgpu.warpgroup.wait_group(1)
                    ring.consumer_release(release)
                    read.advance()
                    release.advance()
                cute.nvgpu.warpgroup.wait_group(0)
                ring.consumer_release(release)
                release.advance()
                self.epilogue(acc, tCcC, mBias, mNormW, eps, mCosSin, k_caches, v_caches,
                              tile_n, [(slot, valid) for _, slot, valid in rows], positions)

    @cute.jit
    def mma_stage(self, ring, state, tiled_mma, acc, tCrA, tCrB, k_blocks: int) -> None:
        """Wait for k-tile ``state`` to land, then issue its wgmmas as one commit group."""
        ring.consumer_wait(state)
        cute.nvgpu.warpgroup.fence()  # orders the accumulator register writes before wgmma
        for kb in cutlass.range_constexpr(k_blocks):
            coord = (None, None, kb, state.index)
            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def epilogue(
        self,
        acc: cute.Tensor,
        tCcC: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mCosSin: cute.Tensor,
        k_caches: tuple,
        v_caches: tuple,
        tile_n: Int32,
        rows: list,
        positions: list,
    ) -> None:
        """This thread's two rows of the tile -> cache rows, from the accumulator registers.
        Register ``4j + 2r + e`` holds row ``r`` (0: the first, 1: +8), column ``8j + e``
        beyond the thread's first column; its NeoX partner is ``D / 16`` groups of 8 on.
        ``rows``: (slot, written?) per row; ``positions``: the RoPE position per row. Both
        rows are finished before either is stored, so no load waits behind a store."""
        half = self.head_dim // 2
        groups = self.bn // 8  # column groups of 8 per row
        head_groups = self.head_dim // 8
        partner = 4 * (head_groups // 2)  # register distance from d to d + D/2
        quad_col = tCcC[0][1]  # this thread's first column: 2 * (lane % 4)
        layer, is_k, base, row_bytes = self.tile_destination(tile_n, k_caches, v_caches,
                                                             quad_col)
        rPair = cute.make_rmem_tensor((2,), self.norm_dtype)
        rW = cute.make_rmem_tensor((4,), Float32)  # norm weights at d, d + 1, d + D/2, +1
        rCos = cute.make_rmem_tensor((2,), Float32)
        rSin = cute.make_rmem_tensor((2,), Float32)
        rWord = cute.make_rmem_tensor((1,), Uint32)
        if const_expr(self.has_bias):
            rB = cute.make_rmem_tensor((2,), BFloat16)
            for j in cutlass.range_constexpr(groups):  # both rows share the column's bias
                col = tile_n * self.bn + quad_col + 8 * j
                cute.autovec_copy(cute.local_tile(mBias, (2,), (col // 2,)), rB)
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        acc[4 * j + 2 * r + e] = _add_rn(acc[4 * j + 2 * r + e],
                                                         rB[e].to(Float32))

        if is_k:
            # R1 for K heads; a V value's R1 is the bf16 rounding of its store.
            for i in cutlass.range_constexpr(self.bn // 2):
                acc[i] = du.round_to_bf16(acc[i])

            # Every lane of the warp is here (is_k is CTA-uniform): safe to shuffle.
            inv_d = Float32(1.0 / self.head_dim)  # exact: D is a power of two
            gCS = [mCosSin[positions[r], None] for r in range(2)]
            for head in cutlass.range_constexpr(self.heads_per_tile):
                first = 4 * head * head_groups  # register of row 0's first head column
                rstd = []
                for r in cutlass.range_constexpr(2):
                    ss = Float32(0.0)
                    for g in cutlass.range_constexpr(head_groups):
                        for e in cutlass.range_constexpr(2):
                            y = acc[first + 4 * g + 2 * r + e]
                            ss = ss + y * y
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1)  # the quad holds
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=2)  # the whole row
                    rstd.append(_rsqrt_approx(ss * inv_d + eps))
                for g in cutlass.range_constexpr(head_groups // 2):
                    d = quad_col + 8 * g  # head column of the first half
                    for h in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(
                            mNormW[layer, None], (2,), ((d + h * half) // 2,)), rPair)
                        for e in cutlass.range_constexpr(2):
                            rW[2 * h + e] = rPair[e].to(Float32)
                    for r in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(gCS[r], (2,), (d // 2,)), rCos)
                        cute.autovec_copy(cute.local_tile(gCS[r], (2,), ((half + d) // 2,)),
                                          rSin)
                        for e in cutlass.range_constexpr(2):
                            i1 = first + 4 * g + 2 * r + e
                            i2 = i1 + partner
                            acc[i1], acc[i2] = _neox_rotate(
                                _r2(acc[i1], rstd[r], rW[e]), _r2(acc[i2], rstd[r], rW[2 + e]),
                                rCos[e], rSin[e],
                            )

        for r in cutlass.range_constexpr(2):
            slot, valid = rows[r]
            if valid:
                row_addr = base + Int64(slot) * row_bytes
                for j in cutlass.range_constexpr(groups):
                    rWord[0] = du.pack_bf16x2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1])  # R3
                    du.store_words(row_addr + 16 * j, rWord, align=4)


# -- compile ------------------------------------------------------------------------------------

_NORM_DTYPES = {"float32": (torch.float32, Float32), "bfloat16": (torch.bfloat16, BFloat16)}


def _build(key: StackedKvProjKey):
    """Tensor-free compile: T, H, slots, max_pos, bs and the cache row strides are symbolic."""
    d = key.head_dim
    kv = key.n_kv * d
    n_total = key.num_layers * 2 * kv
    tokens, hidden = du.sym(), du.sym()
    align = VECTOR_BYTES
    x = du.fake_tensor(BFloat16, (tokens, hidden), (du.sym_stride(CHUNK), 1), align=align)
    w = du.fake_tensor(BFloat16, (n_total, hidden), (du.sym_stride(CHUNK), 1), align=align)
    bias = du.fake_row_major(BFloat16, (n_total,), align=align) if key.has_bias else None
    norm_w = du.fake_row_major(_NORM_DTYPES[key.norm_dtype][1], (key.num_layers, d), align=align)
    pos = du.fake_row_major(Int64, (tokens,), align=8)
    cos_sin = du.fake_row_major(Float32, (du.sym(), d), align=align)
    loc = du.fake_row_major(Int64, (tokens,), align=8)
    commit = du.fake_row_major(Int32, (du.sym(),), align=4) if key.has_commit else None

    def cache():
        return du.fake_tensor(BFloat16, (du.sym(), key.n_kv, d), (du.sym_stride(CHUNK), d, 1),
                              align=align)

    k_caches = tuple(cache() for _ in range(key.num_layers))
    v_caches = tuple(cache() for _ in range(key.num_layers))
    if key.impl == "wgmma" and key.arch != "sm_90a":
        raise LayoutError(f"impl: expected wgmma only for sm_90a, got arch {key.arch}")
    if key.tile not in tiles_for(key.impl):
        raise LayoutError(f"tile: expected one of {tiles_for(key.impl)} for the {key.impl} "
                          f"core, got {key.tile}")
    kernel = IMPLS[key.impl](key.num_layers, key.n_kv, d, key.has_bias, key.has_commit,
                             _NORM_DTYPES[key.norm_dtype][1], TILES[key.tile])
    grid = (Int32(1),) if key.impl == "wgmma" else ()  # the persistent grid's CTA cap
    return du.compile_tvm_ffi(
        kernel, x, w, bias, norm_w, Float32(1e-6), pos, cos_sin, loc, commit, Int32(1),
        k_caches, v_caches, *grid, du.env_stream(), arch=key.arch,
    )


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


def choose_tile(tokens: int, impl: str, num_layers: int, n_kv: int, head_dim: int,
                sms: int = 132) -> str:
    """The tile config for ``tokens`` rows of a layout on core ``impl`` with ``sms`` SMs
    (``CUTE_KERNELS_STACKED_TILE`` overrides): the least ``waves x cost``, a wave being one
    tile per SM and ``cost`` a tile's measured time relative to m128. The wave count is what
    makes m128 beat m128w at T = 512..1024 on the drafter layout (3 and 5 waves against 2 and
    3 of 1.75) and m64 lose to m128 at T = 128 (two waves of 64-row tiles, one of 128)."""
    wanted = os.environ.get(TILE_ENV, "auto")
    if wanted != "auto":
        if wanted not in tiles_for(impl):
            fail(TILE_ENV, f"one of auto, {', '.join(tiles_for(impl))} for the {impl} core",
                 repr(wanted))
        return wanted
    kv = n_kv * head_dim

    def estimate(name: str) -> float:
        tile = TILES[name]
        tiles = -(-tokens // tile.bm) * (num_layers * 2 * kv // tile_n(head_dim, kv, tile.wide))
        return -(-tiles // sms) * tile.cost

    return min(tiles_for(impl), key=estimate)


def _variants(arch: str) -> list[StackedKvProjKey]:
    """The drafter layout built up front: the Qwen3 DSpark/DFlash drafters at TP1 (5 layers,
    D = 128, 8 KV heads), fp32 stacked norm weight, no bias, with and without the commit-lens
    rows, every tile, every core the arch has. Other layouts compile on first use (~1 s)."""
    return [
        StackedKvProjKey(5, 8, 128, False, commit, "float32", tile, impl, arch)
        for impl in impls_for(arch)
        for commit in (False, True)
        for tile in tiles_for(impl)
    ]


IMPLS.update(mma=StackedKvProjMma, wgmma=StackedKvProjWgmma)
KERNELS = KernelCache("stacked_kv_proj", _build, _variants)


# -- validation ---------------------------------------------------------------------------------


def _expect_index(t: object, arg: str, dtype: torch.dtype, device: torch.device) -> None:
    expect_tensor(t, arg)
    expect_same_device(t, arg, device, "ctx_hidden")
    expect_dtype(t, arg, dtype)


def _cache_ok(c: object, device: torch.device, n_kv: int, head_dim: int) -> bool:
    """The common case in one pass (a serving step checks 2L caches per call; this is the
    host-time hot spot of a call)."""
    if not isinstance(c, torch.Tensor) or c.dtype is not torch.bfloat16:
        return False
    shape = c.shape
    if len(shape) != 3 or shape[1] != n_kv or shape[2] != head_dim or c.device != device:
        return False
    s0, s1, s2 = c.stride()
    if s2 != 1 or (n_kv > 1 and s1 != head_dim):
        return False
    if shape[0] > 1 and (s0 < n_kv * head_dim or (s0 * 2) % VECTOR_BYTES):
        return False
    return c.data_ptr() % VECTOR_BYTES == 0  # 0 for meta and empty tensors


def _expect_caches(caches: object, arg: str, device: torch.device, n_kv: int | None,
                   head_dim: int | None) -> tuple[int, int]:
    if not isinstance(caches, (list, tuple)) or len(caches) == 0:
        fail(arg, "a non-empty list of tensors", type(caches).__name__)
    if len(caches) > MAX_LAYERS:
        fail(arg, f"at most {MAX_LAYERS} layers", len(caches))
    for i, c in enumerate(caches):
        if n_kv is None and isinstance(c, torch.Tensor) and c.dim() == 3:
            n_kv, head_dim = c.shape[1], c.shape[2]
        if head_dim in HEAD_DIMS and _cache_ok(c, device, n_kv, head_dim):
            continue
        name = f"{arg}[{i}]"  # something is wrong: find it and say what
        expect_tensor(c, name)
        expect_same_device(c, name, device, "ctx_hidden")
        expect_dtype(c, name, torch.bfloat16)
        expect_rank(c, name, 3)
        if head_dim not in HEAD_DIMS:
            fail(name, f"head dim (shape[2]) in {HEAD_DIMS}", f"shape {tuple(c.shape)}")
        if tuple(c.shape[1:]) != (n_kv, head_dim):
            fail(name, f"shape [slots, {n_kv}, {head_dim}]", f"shape {tuple(c.shape)}")
        if c.stride(2) != 1 or (n_kv > 1 and c.stride(1) != head_dim):
            fail(name, f"strides (s0, {head_dim}, 1)", f"strides {c.stride()}")
        if c.shape[0] > 1 and c.stride(0) < n_kv * head_dim:
            fail(name, f"stride(0) >= {n_kv * head_dim} (rows must not overlap)", c.stride())
        if c.shape[0] > 1 and (c.stride(0) * 2) % VECTOR_BYTES:
            fail(name, f"stride(0) a multiple of {VECTOR_BYTES} bytes",
                 f"{c.stride(0)} elements = {c.stride(0) * 2} bytes")
        expect_base_aligned(c, name, VECTOR_BYTES)
        raise AssertionError(f"{name}: _cache_ok and the detailed checks disagree")
    return n_kv, head_dim


def _expect_rows(t: torch.Tensor, arg: str, inner: int, bk: int | None = None) -> None:
    """bf16 [rows, inner] with unit inner stride and a 16-byte row stride."""
    if t.stride(1) != 1 and t.shape[1] > 1:
        fail(arg, "stride 1 in dim 1", f"strides {t.stride()}")
    if t.shape[0] > 1 and ((t.stride(0) * 2) % VECTOR_BYTES or t.stride(0) < inner):
        fail(arg, f"stride(0) >= {inner} and a multiple of {VECTOR_BYTES} bytes",
             f"strides {t.stride()}")
    expect_base_aligned(t, arg, VECTOR_BYTES)


def _validate(
    ctx_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None,
    commit_lens: torch.Tensor | None,
    require_cuda: bool,
) -> StackedKvProjKey | None:
    """Raise :class:`LayoutError` for anything the kernel does not support; return the compile
    key (None when the tensors carry no arch: meta or CPU tensors)."""
    expect_tensor(ctx_hidden, "ctx_hidden")
    expect_dtype(ctx_hidden, "ctx_hidden", torch.bfloat16)
    expect_rank(ctx_hidden, "ctx_hidden", 2)
    device = ctx_hidden.device
    if require_cuda and device.type != "cuda":
        fail("ctx_hidden", "a CUDA tensor", f"device {device}")
    tokens, hidden = ctx_hidden.shape
    bk = 64  # one k-tile of both cores
    if hidden == 0 or hidden % bk:
        fail("ctx_hidden", f"a hidden size (shape[1]) that is a positive multiple of {bk}",
             f"shape {tuple(ctx_hidden.shape)}")
    _expect_rows(ctx_hidden, "ctx_hidden", hidden)

    num_layers = len(k_caches) if isinstance(k_caches, (list, tuple)) else 0
    n_kv, head_dim = _expect_caches(k_caches, "k_caches", device, None, None)
    _expect_caches(v_caches, "v_caches", device, n_kv, head_dim)
    if len(v_caches) != num_layers:
        fail("v_caches", f"{num_layers} tensors (one per layer, like k_caches)", len(v_caches))
    kv = n_kv * head_dim

    expect_tensor(weight, "weight")
    expect_same_device(weight, "weight", device, "ctx_hidden")
    expect_dtype(weight, "weight", torch.bfloat16)  # unquantised weights only
    expect_rank(weight, "weight", 2)
    if tuple(weight.shape) != (num_layers * 2 * kv, hidden):
        fail("weight", f"shape [L*2*n_kv*D, H] = [{num_layers * 2 * kv}, {hidden}] "
             f"(L={num_layers}, n_kv={n_kv}, D={head_dim})", f"shape {tuple(weight.shape)}")
    _expect_rows(weight, "weight", hidden)
    bn = tile_n(head_dim, kv)
    if kv % bn or bn % head_dim:
        fail("weight", f"kv = n_kv*D a multiple of the {bn}-column tile", f"kv = {kv}")

    if bias is not None:
        expect_tensor(bias, "bias")
        expect_same_device(bias, "bias", device, "ctx_hidden")
        expect_dtype(bias, "bias", torch.bfloat16)
        expect_rank(bias, "bias", 1)
        if bias.shape[0] != weight.shape[0]:
            fail("bias", f"{weight.shape[0]} entries (one per weight row)", tuple(bias.shape))
        expect_contiguous(bias, "bias")
        expect_base_aligned(bias, "bias", VECTOR_BYTES)

    expect_tensor(k_norm_weight, "k_norm_weight")
    expect_same_device(k_norm_weight, "k_norm_weight", device, "ctx_hidden")
    expect_dtype(k_norm_weight, "k_norm_weight", torch.float32, torch.bfloat16)
    expect_rank(k_norm_weight, "k_norm_weight", 2)
    if tuple(k_norm_weight.shape) != (num_layers, head_dim):
        fail("k_norm_weight", f"shape [L, D] = [{num_layers}, {head_dim}]",
             f"shape {tuple(k_norm_weight.shape)}")
    expect_contiguous(k_norm_weight, "k_norm_weight")
    expect_base_aligned(k_norm_weight, "k_norm_weight", VECTOR_BYTES)

    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
        0 <= float(eps) < math.inf
    ):
        fail("eps", "a finite non-negative float", repr(eps))

    for name, t in (("positions", positions), ("cache_loc", cache_loc)):
        _expect_index(t, name, torch.int64, device)
        expect_rank(t, name, 1)
        if t.shape[0] != tokens:
            fail(name, f"{tokens} entries (one per ctx_hidden row)", f"shape {tuple(t.shape)}")
        expect_contiguous(t, name)

    expect_tensor(cos_sin_cache, "cos_sin_cache")
    expect_same_device(cos_sin_cache, "cos_sin_cache", device, "ctx_hidden")
    expect_dtype(cos_sin_cache, "cos_sin_cache", torch.float32)
    expect_rank(cos_sin_cache, "cos_sin_cache", 2)
    if cos_sin_cache.shape[1] != head_dim or cos_sin_cache.shape[0] == 0:
        fail("cos_sin_cache", f"shape [max_pos >= 1, D = {head_dim}]",
             f"shape {tuple(cos_sin_cache.shape)}")
    expect_contiguous(cos_sin_cache, "cos_sin_cache")
    expect_base_aligned(cos_sin_cache, "cos_sin_cache", VECTOR_BYTES)

    if (cache_loc_2d is None) != (commit_lens is None):
        missing = "commit_lens" if commit_lens is None else "cache_loc_2d"
        fail(missing, "a tensor: cache_loc_2d and commit_lens come together", None)
    if cache_loc_2d is not None:
        _expect_index(cache_loc_2d, "cache_loc_2d", torch.int64, device)
        expect_rank(cache_loc_2d, "cache_loc_2d", 2)
        expect_contiguous(cache_loc_2d, "cache_loc_2d")
        if cache_loc_2d.numel() != tokens or cache_loc_2d.shape[1] == 0:
            fail("cache_loc_2d", f"shape [bs, W] with bs*W = T = {tokens}",
                 f"shape {tuple(cache_loc_2d.shape)}")
        _expect_index(commit_lens, "commit_lens", torch.int32, device)
        expect_rank(commit_lens, "commit_lens", 1)
        expect_contiguous(commit_lens, "commit_lens")
        if commit_lens.shape[0] != cache_loc_2d.shape[0]:
            fail("commit_lens", f"{cache_loc_2d.shape[0]} entries (cache_loc_2d.shape[0])",
                 f"shape {tuple(commit_lens.shape)}")

    arch = arch_for(device)
    if arch is None:
        return None
    norm = "float32" if k_norm_weight.dtype == torch.float32 else "bfloat16"
    impl = choose_impl(arch)
    tile = choose_tile(tokens, impl, num_layers, n_kv, head_dim, _sm_count(device))
    return StackedKvProjKey(num_layers, n_kv, head_dim, bias is not None,
                            cache_loc_2d is not None, norm, tile, impl, arch)


def check_stacked_kv_proj(
    ctx_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None = None,
    commit_lens: torch.Tensor | None = None,
) -> None:
    """Raise :class:`LayoutError` if :func:`stacked_kv_proj` would reject these arguments.

    Reads metadata only: ``meta`` tensors work. On meta/CPU tensors the arch is checked only
    when ``CUTE_KERNELS_ARCH`` names one.
    """
    _validate(ctx_hidden, weight, bias, k_norm_weight, eps, positions, cos_sin_cache, cache_loc,
              k_caches, v_caches, cache_loc_2d, commit_lens, require_cuda=False)


_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached: a serving step must not query); 132 (the H200) for
    tensors without one."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def _persistent_ctas(device: torch.device, key: StackedKvProjKey) -> int:
    """CTA cap of the wgmma core's persistent grid: one CTA per SM (its ring fills the SMEM),
    as many as the driver reports resident."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    warpgroups = 1 + TILES[key.tile].bm // 64
    return max_active_clusters(index, 1, 1, 128 * warpgroups)


@mutating_op("stacked_kv_proj", mutates_args=("k_caches", "v_caches"))
def _stacked_kv_proj_op(
    ctx_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None = None,
    commit_lens: torch.Tensor | None = None,
) -> None:
    key = _validate(ctx_hidden, weight, bias, k_norm_weight, eps, positions, cos_sin_cache,
                    cache_loc, k_caches, v_caches, cache_loc_2d, commit_lens, require_cuda=True)
    tokens = ctx_hidden.shape[0]
    if tokens == 0:
        return
    loc = cache_loc if cache_loc_2d is None else cache_loc_2d.reshape(-1)
    width = 1 if cache_loc_2d is None else cache_loc_2d.shape[1]
    grid = () if key.impl == "mma" else (_persistent_ctas(ctx_hidden.device, key),)
    KERNELS.get(key)(ctx_hidden, weight, bias, k_norm_weight, float(eps), positions,
                     cos_sin_cache, loc, commit_lens, width, tuple(k_caches), tuple(v_caches),
                     *grid)


def stacked_kv_proj(
    ctx_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None = None,
    commit_lens: torch.Tensor | None = None,
) -> None:
    """All layers' K/V projection + K RMSNorm + NeoX RoPE, written into the KV caches.

    One launch, no intermediate in global memory; launches on the current stream with no host
    sync or allocation (CUDA-graph safe). ``cache_loc_2d`` (with ``commit_lens``) replaces
    ``cache_loc`` when given; negative slots are skipped. See specs/stacked_kv_proj.md.
    """
    if torch.compiler.is_compiling():  # keep the kernel opaque to Dynamo
        torch.ops.cute_kernels.stacked_kv_proj(
            ctx_hidden, weight, bias, k_norm_weight, eps, positions, cos_sin_cache, cache_loc,
            k_caches, v_caches, cache_loc_2d, commit_lens,
        )
    else:  # eager: skip the dispatcher's per-call overhead
        _stacked_kv_proj_op(
            ctx_hidden, weight, bias, k_norm_weight, eps, positions, cos_sin_cache, cache_loc,
            k_caches, v_caches, cache_loc_2d, commit_lens,
        )


__all__ = [
    "SUPPORTED_ARCHS",
    "LayoutError",
    "StackedKvProjKey",
    "StackedKvProjMma",
    "StackedKvProjWgmma",
    "check_stacked_kv_proj",
    "stacked_kv_proj",
]
