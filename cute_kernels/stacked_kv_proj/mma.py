"""Portable stacked KV projection core: ``cp.async`` + warp ``mma.sync``, one tile (or one
k-range of a tile) per CTA, the accumulators staged through SMEM for the norm/RoPE/scatter
epilogue. Runs on sm_80 and later: the core of sm_100a, the fallback of sm_90a and, with the
swapped decode tile, the core of the split decode plan on both."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, const_expr

from .. import dsl_utils as du
from .base import StackedKvProjBase
from .plan import C_ROW_PAD, TileConfig, gather_bytes, ring_bytes, swap_ring
from .staged import CHUNK, StagedEpilogue

SMEM_BUDGET = 200 * 1024  # bytes of A/B ring per CTA (227 KiB is the sm_90/sm_100 maximum)


class StackedKvProjMma(StagedEpilogue, StackedKvProjBase):
    """Portable ``mma.sync`` GEMM + norm/RoPE/scatter epilogue (runs on sm_80 and later).

    The fp32 accumulators go through SMEM, to the epilogue of :class:`~.staged.StagedEpilogue`.

    Swapped tiles (decode sizes): the MMA computes ``W_tile @ X_tile^T`` — the ``bn`` weight
    rows are its M (four warps of 32 rows) and the ``bm`` tokens its N — so each ring stage is
    ``bn`` weight rows plus only ``bm`` token rows, and the staging writes the transposed
    fragment into the same ``[token, column]`` SMEM tile the epilogue reads.

    Split K (``splits > 1``, any tile): CTA ``b`` runs k-tiles ``[s K / S, (s + 1) K / S)`` of
    tile ``b / S`` (``s = b mod S``). Two hand-overs of the partials, a compiled variant each:
    - *cluster* (``cluster=True``, ``S <= CLUSTER_MAX_SPLITS``): the ``S`` CTAs of a tile are
      one cluster; each stages its fp32 partial in its own SMEM, and after a cluster barrier
      CTA ``s`` sums the ``s``-th ``1/S`` of the valid rows of all ``S`` partials through
      distributed shared memory and finishes those rows;
    - *workspace*: each CTA stores its partial (rows ``< T``) to its workspace slot and counts
      itself on the tile's counter (release); the CTA that arrives last (acquire) sums all
      partials, runs the epilogue and resets the counter for the next launch (nobody waits
      for anybody, so no co-residency is needed).
    Either way the sum is in split order ``((p0 + p1) + p2) + ...``: a fixed order, so the
    result is bitwise the same run to run, and the same for both hand-overs."""

    #: warps of a swapped tile's CTA along the MMA's (M, N): 32 weight rows each, all tokens
    SWAP_WARPS = (4, 1)

    def __init__(self, num_layers: int, n_kv: int, head_dim: int, has_bias: bool,
                 has_commit: bool, norm_dtype: type, tile: TileConfig, cluster: bool) -> None:
        assert not tile.wide, "the mma core has no wide tile"
        self.swap = tile.swap
        self.cluster = cluster  # split partials handed over through DSMEM (else the workspace)
        # warps along the MMA's (M, N): weight rows x tokens when swapped
        self.warps_m, self.warps_n = self.SWAP_WARPS if tile.swap else (2, tile.bm // 32)
        super().__init__(num_layers, n_kv, head_dim, has_bias, has_commit, norm_dtype, tile,
                         32 * self.warps_m * self.warps_n)
        if tile.swap:
            self.stages = swap_ring(tile, self.bn)[0]
        else:
            self.stages = self.ring_stages(tile.mma_stages, SMEM_BUDGET)
        self.mma_m, self.mma_n = (self.bn, self.bm) if tile.swap else (self.bm, self.bn)
        assert self.mma_m % (16 * self.warps_m) == 0 and self.mma_n % (16 * self.warps_n) == 0
        self.init_staged_epilogue(self.threads, self.bn + C_ROW_PAD)
        # the ring beyond the staged C tile, where a split tile's last CTA gathers partials
        self.c_bytes = ring_bytes(self.stages, self.bm, self.bn) - gather_bytes(
            self.stages, self.bm, self.bn)
        self.gather_bytes = gather_bytes(self.stages, self.bm, self.bn)
        assert self.gather_bytes >= 0 and self.c_bytes % 16 == 0, "C reuses the A/B ring"

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
        mWork: cute.Tensor,
        mCount: cute.Tensor,
        splits: Int32,
        stream: cuda.CUstream,
    ) -> None:
        mLoc = self.token_slots(mLoc)
        sA_layout = self._smem_layout_ab(self.mma_m)
        sB_layout = self._smem_layout_ab(self.mma_n)
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
        kernel = self.kernel(
            mX, mW, mBias, mNormW, eps, mPos, mCosSin, mLoc, mCommit, width, k_caches, v_caches,
            mWork, mCount, splits, sA_layout, sB_layout, copy_a, copy_b, tiled_mma,
        )
        grid = [num_m_tiles * self.num_n_tiles * splits, 1, 1]
        if const_expr(self.cluster):  # a tile's splits (at most CLUSTER_MAX_SPLITS): a cluster
            kernel.launch(grid=grid, block=[self.threads, 1, 1], cluster=[splits, 1, 1],
                          stream=stream)
        else:  # (a cluster launch, even of 1 CTA, measured slower: TP 1, T = 32, 39.6 vs 33.8 us)
            kernel.launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

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
        mWork: cute.Tensor,
        mCount: cute.Tensor,
        splits: Int32,
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
        tile = bid // splits
        split = bid - tile * splits
        tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
        k_tiles = mX.shape[1] // self.bk
        k_lo = split * k_tiles // splits
        k_hi = (split + 1) * k_tiles // splits

        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(BFloat16, sA_layout, 1024)
        sB = smem.allocate_tensor(BFloat16, sB_layout, 1024)
        sLast = smem.allocate_tensor(Int32, cute.make_layout(1), 4)

        # The epilogue's row metadata, bias and norm weights, requested now: they land while
        # the main loop runs.
        rSlot, rPos, rCommitted, rCos, rSin, rBias, rNorm = self.epilogue_inputs(
            mBias, mNormW, mPos, mLoc, mCommit, width, tile_m, tile_n, tidx)

        if const_expr(self.swap):  # weight rows are the MMA's M, tokens its N
            tCrC = self.mainloop(mW, tile_n, mX, tile_m, sA, sB, copy_a, copy_b, tiled_mma,
                                 k_lo, k_hi, tidx)
        else:
            tCrC = self.mainloop(mX, tile_m, mW, tile_n, sA, sB, copy_a, copy_b, tiled_mma,
                                 k_lo, k_hi, tidx)

        # fp32 accumulators -> padded [token, column] SMEM tile (reusing the ring), then the
        # epilogue mapping
        sC = self.staged_tile(sA.iterator)
        self.stage_fragment(tiled_mma, tidx, tCrC, sC, self.swap)
        if const_expr(self.cluster):
            if splits > 1:
                self.arrive_staged()
        _, first_column = self.tile_layer(tile_n)
        self.rope_inputs(mCosSin, tile_m, first_column < self.kv, num_tokens, tidx, rSlot,
                         rPos, rCommitted, rCos, rSin)
        cute.arch.sync_threads()
        finishes = Boolean(True)
        row_lo, row_hi = Int32(0), Int32(self.bm)  # the tile rows this CTA finishes
        if splits > 1:
            rows_valid = cutlass.min(num_tokens - tile_m * self.bm, self.bm)
            if const_expr(self.cluster):
                row_lo, row_hi = self.reduce_cluster(sC, split, splits, rows_valid, tidx)
            else:
                finishes = self.reduce_splits(sC, sLast, mWork, mCount, tile, split, splits,
                                              rows_valid, tidx)
        if finishes:
            self.epilogue(sC, eps, num_tokens, k_caches, v_caches, tile_m, tile_n, tidx, rSlot,
                          rCommitted, rCos, rSin, rBias, rNorm, row_lo, row_hi)
        if const_expr(self.cluster):
            if splits > 1:
                cute.arch.cluster_wait()  # the peers' reads of this CTA's partial are done

    @cute.jit
    def reduce_splits(self, sC: cute.Tensor, sLast: cute.Tensor, mWork: cute.Tensor,
                      mCount: cute.Tensor, tile: Int32, split: Int32, splits: Int32,
                      rows_valid: Int32, tidx: Int32) -> Boolean:
        """Hand this CTA's partial of ``tile`` (in ``sC``) over; if it is the last of the
        tile's ``splits`` to arrive, leave the sum of all partials in split order in ``sC``
        (rows ``< rows_valid``) and return True.

        Thread ``t`` owns the 16-byte chunks ``t, t + threads, ...`` of the valid rows: it
        stores them, and, in the last CTA, gathers the same chunks of every partial with
        ``cp.async`` (all of a batch in flight: one L2 round trip per batch) and sums them, so
        no barrier is needed between its copies and its sums. A batch is as many partials as
        the ring holds beyond ``sC``."""
        vectors = self.bn // 4  # 16-byte chunks per row
        chunks = rows_valid * vectors
        partial_bytes = self.bm * self.bn * 4
        tile_slots = mWork.iterator.toint() + Int64(tile) * splits * partial_bytes
        counter = mCount.iterator.toint() + Int64(tile) * 4
        c_base = Int32(sC.iterator.toint())
        for q in cutlass.range(tidx, chunks, self.threads, unroll=1):
            row = q // vectors
            col = (q - row * vectors) * 4
            v0, v1, v2, v3 = du.load_shared_v4(c_base + (row * self.c_stride + col) * 4,
                                               Float32)
            du.store_f32x4(tile_slots + Int64(split) * partial_bytes
                           + Int64(row * self.bn + col) * 4, v0, v1, v2, v3)
        last = self.arrive(counter, splits, sLast, tidx)
        if last:
            g_base = c_base + self.c_bytes  # the ring beyond sC
            batch = cutlass.max(self.gather_bytes // (chunks * 16), 1)
            for first in cutlass.range(0, splits, batch, unroll=1):
                count = cutlass.min(batch, splits - first)
                for c in cutlass.range(count, unroll=1):
                    src = tile_slots + Int64(first + c) * partial_bytes
                    for q in cutlass.range(tidx, chunks, self.threads, unroll=1):
                        row = q // vectors
                        col = (q - row * vectors) * 4
                        du.cp_async_16(g_base + (c * chunks + q) * 16,
                                       src + Int64(row * self.bn + col) * 4)
                du.cp_async_commit()
                du.cp_async_wait(0)
                for q in cutlass.range(tidx, chunks, self.threads, unroll=1):
                    row = q // vectors
                    at = c_base + (row * self.c_stride + (q - row * vectors) * 4) * 4
                    s0, s1, s2, s3 = du.load_shared_v4(at, Float32)
                    for c in cutlass.range(count, unroll=1):
                        p0, p1, p2, p3 = du.load_shared_v4(g_base + (c * chunks + q) * 16,
                                                           Float32)
                        if (first == 0) & (c == 0):
                            s0, s1, s2, s3 = p0, p1, p2, p3
                        else:
                            s0 = du.add_rn(s0, p0)
                            s1 = du.add_rn(s1, p1)
                            s2 = du.add_rn(s2, p2)
                            s3 = du.add_rn(s3, p3)
                    du.store_shared_v4(at, s0, s1, s2, s3)
            cute.arch.sync_threads()  # the epilogue reads sC with another mapping
        return last

    @cute.jit
    def mainloop(
        self,
        mA: cute.Tensor,
        tile_a: Int32,
        mB: cute.Tensor,
        tile_b: Int32,
        sA: cute.Tensor,
        sB: cute.Tensor,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        k_lo: Int32,
        k_hi: Int32,
        tidx: Int32,
    ) -> cute.Tensor:
        """``acc = A[tile_a] @ B[tile_b]^T`` over k-tiles ``[k_lo, k_hi)``; returns the fp32
        fragment. A and B are ``ctx_hidden`` and ``weight``, or the reverse when swapped."""
        gA = cute.local_tile(mA, (self.mma_m, self.bk), (tile_a, None))  # (rows, bk, k_tiles)
        gB = cute.local_tile(mB, (self.mma_n, self.bk), (tile_b, None))
        cA = cute.local_tile(cute.make_identity_tensor(mA.shape), (self.mma_m, self.bk),
                             (tile_a, None))
        cB = cute.local_tile(cute.make_identity_tensor(mB.shape), (self.mma_n, self.bk),
                             (tile_b, None))
        thr_a = copy_a.get_slice(tidx)
        thr_b = copy_b.get_slice(tidx)
        tAgA, tAsA = thr_a.partition_S(gA), thr_a.partition_D(sA)
        tBgB, tBsB = thr_b.partition_S(gB), thr_b.partition_D(sB)

        # Token rows beyond T are never loaded (their SMEM rows hold stale data, which only
        # reaches accumulator rows that are never stored: the GEMM is row-independent). The
        # weight operand is predicated the same way; its rows are always in range.
        tApA = self._row_predicate(tAgA, thr_a.partition_S(cA), mA.shape[0])
        tBpB = self._row_predicate(tBgB, thr_b.partition_S(cB), mB.shape[0])
        k_count = k_hi - k_lo
        # the weight's L2 policy (A and B are both K-major: [rows, H])
        evict_first = self.weight_evict_first(mA.shape[1])
        stream = du.evict_first_policy()
        operand_a = (copy_a, tAgA, tAsA, tApA, mA, tile_a, self.mma_m, sA)
        operand_b = (copy_b, tBgB, tBsB, tBpB, mB, tile_b, self.mma_n, sB)

        # Prologue: stages - 1 tiles in flight (fewer when the range is short; every group
        # committed).
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < k_count:
                self.load_operands(operand_a, operand_b, k_lo + s, s, tidx, evict_first,
                                   stream)
            cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        tCrC = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.mma_m, self.mma_n)),
                                     Float32)
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

        for _k_tile in range(k_count):
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
                    if next_tile < k_count:
                        self.load_operands(operand_a, operand_b, k_lo + next_tile,
                                           write_stage, tidx, evict_first, stream)
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

    def load_operands(self, a: tuple, b: tuple, k_tile: Int32, stage: Int32, tidx: Int32,
                      evict_first: cutlass.Boolean, stream: Int64) -> None:
        """Start the copies of k-tile ``k_tile`` of both operands (``a``, ``b``: see
        :meth:`load_operand`) into ring stage ``stage``; the weight is A when swapped."""
        self.load_operand(a, self.swap, k_tile, stage, tidx, evict_first, stream)
        self.load_operand(b, not self.swap, k_tile, stage, tidx, evict_first, stream)

    @cute.jit
    def load_operand(self, operand: tuple, is_weight: bool, k_tile: Int32, stage: Int32,
                     tidx: Int32, evict_first: cutlass.Boolean, stream: Int64) -> None:
        """One operand's copies, ``operand = (tiled copy, its source and destination
        partitions, row predicate, global tensor, tile index, rows, SMEM ring)``: by the
        tiled copy (the tokens predicated on ``T``), except the weight's when ``evict_first``:
        then :meth:`load_weight_stage`, with the L2 policy ``stream``."""
        copy, tXgX, tXsX, tXpX, mX, tile, rows, sX = operand
        if const_expr(is_weight):
            if evict_first:
                self.load_weight_stage(mX, tile, rows, sX, k_tile, stage, tidx, stream)
            else:
                cute.copy(copy, tXgX[None, None, None, k_tile],
                          tXsX[None, None, None, stage], pred=tXpX)
        else:
            cute.copy(copy, tXgX[None, None, None, k_tile], tXsX[None, None, None, stage],
                      pred=tXpX)

    @cute.jit
    def load_weight_stage(self, mW: cute.Tensor, tile: Int32, rows: int, sW: cute.Tensor,
                          k_tile: Int32, stage: Int32, tidx: Int32, stream: Int64) -> None:
        """K-tile ``k_tile`` of weight tile ``tile`` (``rows`` rows) into ring stage ``stage``
        of ``sW``: the tiled copy's 16-byte copies (thread ``t`` chunk ``t mod 8`` of rows
        ``t / 8 + i threads / 8``) at the ring's swizzled addresses (:meth:`_smem_layout_ab`:
        chunk ``c`` of row ``r`` at ``c ^ (r mod 8)``), with the L2 cache policy ``stream``
        (``dsl_utils.evict_first_policy``): a tiled copy cannot carry one."""
        per_row = self.bk // CHUNK
        rows_per_pass = self.threads // per_row
        chunk = tidx % per_row
        row_bytes = self.bk * 2
        base = Int32(sW.iterator.toint()) + stage * (rows * row_bytes)
        src = (mW.iterator.toint() + (Int64(tile * rows) * mW.stride[0] + k_tile * self.bk
                                      + chunk * CHUNK) * 2)
        for i in cutlass.range_constexpr(rows // rows_per_pass):
            r = tidx // per_row + i * rows_per_pass
            du.cp_async_16(base + r * row_bytes + (chunk ^ (r % 8)) * 16,
                           src + Int64(r) * mW.stride[0] * 2, stream)

    @staticmethod
    def _row_predicate(tXgX: cute.Tensor, tXcX: cute.Tensor, rows: Int32) -> cute.Tensor:
        """Per copy of a thread's partition: whether its row is below ``rows`` (the same for
        every k-tile)."""
        tXpX = cute.make_rmem_tensor(
            cute.make_layout(
                (tXgX.shape[0][1], cute.size(tXgX, mode=[1]), cute.size(tXgX, mode=[2])),
                stride=(cute.size(tXgX, mode=[1]), 1, 0),
            ),
            Boolean,
        )
        for v in range(tXpX.shape[0]):  # a plain helper: unrolled at trace time
            for m in range(tXpX.shape[1]):
                tXpX[v, m, 0] = cute.elem_less(tXcX[(0, v), m, 0, 0][0], rows)
        return tXpX
