"""Portable stacked KV projection core: ``cp.async`` + warp ``mma.sync``, one tile per CTA, the
accumulators staged through SMEM for the norm/RoPE/scatter epilogue. Runs on sm_80 and later:
the core of sm_100a, and the fallback of sm_90a."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr

from .. import dsl_utils as du
from .base import StackedKvProjBase, neox_rotate, r1, r2
from .plan import TileConfig

CHUNK = 8  # columns per thread per half head in the epilogue (one 16-byte bf16 vector)
SMEM_BUDGET = 200 * 1024  # bytes of A/B ring per CTA (227 KiB is the sm_90/sm_100 maximum)


class StackedKvProjMma(StackedKvProjBase):
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
        g2s = du.cp_async_atom(BFloat16)
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
                    rY[h * CHUNK + i] = r1(
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
                rstd = du.rsqrt_approx(ss * inv_d + eps)
                for i in cutlass.range_constexpr(2 * CHUNK):
                    rY[i] = r2(rY[i], rstd, rNorm[i])
                position = cutlass.select_(valid, mPos[t], Int64(0))
                gCS = mCosSin[position, None]
                cute.autovec_copy(cute.local_tile(gCS, (CHUNK,), (lane_in_head,)), rCos)
                cute.autovec_copy(
                    cute.local_tile(gCS, (CHUNK,), ((half + d_lo) // CHUNK,)), rSin
                )
                for i in cutlass.range_constexpr(CHUNK):
                    rY[i], rY[CHUNK + i] = neox_rotate(rY[i], rY[CHUNK + i], rCos[i], rSin[i])

            if valid:
                row_addr = base + Int64(slot) * row_bytes
                for h in cutlass.range_constexpr(2):
                    for w in cutlass.range_constexpr(CHUNK // 2):
                        rOut[w] = du.pack_bf16x2(  # R3 (K) / exact (V)
                            rY[h * CHUNK + 2 * w], rY[h * CHUNK + 2 * w + 1]
                        )
                    du.store_words(row_addr + h * half * 2, rOut)
