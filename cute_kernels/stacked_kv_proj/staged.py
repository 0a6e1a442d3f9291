"""The SMEM-staged epilogue of the stacked KV projection, shared by the cores whose
accumulators do not hold whole head rows per quad (the portable ``mma`` core and the swapped
``wgmma`` core): the fp32 accumulators are staged as a padded ``[token, column]`` tile, and a
second thread mapping gives each thread 8 columns of one head's first half and their 8 NeoX
partners ``d + D/2`` of one row, so the pair is register-local, the sum of squares is an
in-thread sum plus a butterfly over the ``D / 16`` threads of the head, and each half leaves
as one 16-byte store."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, Uint32, const_expr

from .. import dsl_utils as du
from .base import neox_rotate, r1, r2
from .plan import CLUSTER_MAX_SPLITS

CHUNK = 8  # columns per thread per half head in the epilogue (one 16-byte bf16 vector)


class StagedEpilogue:
    """Mixin of a :class:`~.base.StackedKvProjBase` core: the epilogue over a staged fp32
    ``[bm tokens, bn columns]`` SMEM tile (row stride ``c_stride`` floats)."""

    def init_staged_epilogue(self, threads: int, c_stride: int,
                             barrier_id: int | None = None) -> None:
        """The epilogue's thread mapping over ``threads`` threads: ``lanes_per_head`` threads
        per (row, head), the tile's heads next, rows last (``row_step`` rows apart); each
        thread keeps its columns for every row it handles. A tile of fewer rows than a step,
        or not a multiple of it, gives the extra thread rows row ``bm - 1`` again, stored by
        none. ``barrier_id``: the named barrier of those threads when they are not the whole
        CTA (None: they are)."""
        self.epilogue_threads = threads
        self.epilogue_barrier_id = barrier_id
        self.lanes_per_head = self.head_dim // (2 * CHUNK)
        self.row_step = self.epilogue_row_step(threads)
        assert self.row_step >= 1
        self.rows_per_thread = -(-self.bm // self.row_step)
        self.c_stride = c_stride
        assert c_stride % 4 == 0, "16-byte rows of the staged tile"

    def epilogue_row_step(self, threads: int) -> int:
        """Tile rows that ``threads`` epilogue threads take at once: ``D / 16`` threads a
        (row, head)."""
        return threads // (self.head_dim // (2 * CHUNK) * self.heads_per_tile)

    def sync_epilogue_threads(self) -> None:
        """A barrier of the epilogue's threads (the CTA's, or their named one)."""
        if const_expr(self.epilogue_barrier_id is None):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=self.epilogue_barrier_id,
                              number_of_threads=self.epilogue_threads)

    def staged_tile(self, smem: cute.Pointer) -> cute.Tensor:
        """The ``[bm, bn]`` fp32 tile staged at ``smem`` (the drained ring)."""
        return cute.make_tensor(cute.recast_ptr(smem, dtype=Float32),
                                cute.make_layout((self.bm, self.bn), stride=(self.c_stride, 1)))

    @cute.jit
    def stage_fragment(self, tiled_mma: cute.TiledMma, thread: Int32, frag: cute.Tensor,
                       sC: cute.Tensor, swapped: bool) -> None:
        """This thread's accumulator fragment into ``sC``; a ``swapped`` MMA (weight columns
        as its M, tokens as its N) writes through the transposed view."""
        sC_mma = sC
        if const_expr(swapped):
            sC_mma = cute.make_tensor(sC.iterator, cute.make_layout(
                (self.bn, self.bm), stride=(1, self.c_stride)))
        cute.autovec_copy(frag, tiled_mma.get_slice(thread).partition_C(sC_mma))

    def arrive_staged(self) -> None:
        """The first cluster barrier of :meth:`reduce_cluster`, arrived as soon as this
        thread's share of the partial is staged and before :meth:`rope_inputs` requests the
        cos/sin rows: the arrive's release waits for every earlier memory access of the
        thread to be performed, those loads' DRAM round trip included."""
        cute.arch.cluster_arrive()  # release: this thread's share of the partial is staged

    @cute.jit
    def reduce_cluster(self, sC: cute.Tensor, rank: Int32, splits: Int32, rows_valid: Int32,
                       tidx: Int32) -> tuple[Int32, Int32]:
        """The DSMEM hand-over of a tile whose ``splits`` CTAs (K ranges) are one cluster,
        each with its partial staged in ``sC``: this CTA (rank ``rank``) sums rows ``[lo,
        hi)``, its ``1/splits`` of the ``rows_valid`` valid rows, of every partial in split
        order ``((p0 + p1) + p2) + ...`` (fixed: bitwise the same run to run) into its own
        ``sC`` and returns ``(lo, hi)``, the rows it finishes. The slices are disjoint, so no
        CTA writes rows another reads. Every thread of the CTA takes part in both cluster
        barriers (the epilogue's threads here; any others must arrive, wait and arrive
        too): the first (arrived by :meth:`arrive_staged`, waited on here) says every
        partial is staged, the second (arrived here, waited on by the caller before
        exiting) that this CTA has read its peers', so every partial outlives its readers.

        Epilogue thread ``t`` sums the 16-byte chunks ``t, t + threads, ...`` of the slice:
        one ``ld.shared::cluster`` per partial, all issued before the first add, so one DSMEM
        round trip per chunk. The split is a runtime value, so the loads are unrolled for
        ``CLUSTER_MAX_SPLITS`` ranks and predicated off past ``splits`` (no bytes move for
        them, and they are not added). Loading the last rank's chunk in their place, as
        before, moved up to 4x the partials' bytes through DSMEM (a 2-way split of a 128 x
        128 tile: its hand-over, this wait included, took ~7 us on an H100; PERF.md)."""
        cute.arch.cluster_wait()  # acquire: every partial of the tile is staged
        row_lo = rank * rows_valid // splits
        row_hi = (rank + 1) * rows_valid // splits
        vectors = self.bn // 4  # 16-byte chunks per row
        c_base = Int32(sC.iterator.toint())
        # Per rank, the same for every chunk: whether it is one of the split's (its load is
        # issued and its partial added) and the peer its load names (a valid rank even when
        # the load is predicated off).
        in_split, peers = [], []
        for p in cutlass.range_constexpr(CLUSTER_MAX_SPLITS):
            in_split.append(Int32(p) < splits)
            peers.append(cutlass.min(Int32(p), splits - 1))
        for q in cutlass.range(tidx, (row_hi - row_lo) * vectors, self.epilogue_threads,
                               unroll=1):
            row = q // vectors
            at = c_base + ((row_lo + row) * self.c_stride + (q - row * vectors) * 4) * 4
            parts = []
            for p in cutlass.range_constexpr(CLUSTER_MAX_SPLITS):
                parts.append(du.load_peer_v4(at, peers[p], Int32(in_split[p])))
            s0, s1, s2, s3 = parts[0]
            for p in cutlass.range_constexpr(1, CLUSTER_MAX_SPLITS):
                p0, p1, p2, p3 = parts[p]
                s0 = cutlass.select_(in_split[p], du.add_rn(s0, p0), s0)
                s1 = cutlass.select_(in_split[p], du.add_rn(s1, p1), s1)
                s2 = cutlass.select_(in_split[p], du.add_rn(s2, p2), s2)
                s3 = cutlass.select_(in_split[p], du.add_rn(s3, p3), s3)
            du.store_shared_v4(at, s0, s1, s2, s3)
        self.sync_epilogue_threads()  # the epilogue reads sC with another mapping
        # This CTA has read its peers' partials: every load's value is already summed and
        # stored, so they are complete and a relaxed arrive suffices. A release would cost a
        # MEMBAR.ALL.GPU + ERRBAR, which also waits for the cos/sin rows still in flight.
        cute.arch.cluster_arrive_relaxed()
        return row_lo, row_hi

    @cute.jit
    def epilogue_inputs(self, mBias: cute.Tensor | None, mNormW: cute.Tensor,
                        mPos: cute.Tensor, mLoc: cute.Tensor, mCommit: cute.Tensor | None,
                        width: Int32, tile_m: Int32, tile_n: Int32, tidx: Int32) -> tuple:
        """The registers of this thread's epilogue inputs, the row metadata, bias and norm
        weights requested now (:meth:`row_inputs`, :meth:`column_inputs`) and the cos/sin
        rows to be requested by :meth:`rope_inputs`: ``(rSlot, rPos, rCommitted, rCos, rSin,
        rBias, rNorm)``."""
        rSlot = cute.make_rmem_tensor((self.rows_per_thread,), Int64)
        rPos = cute.make_rmem_tensor((self.rows_per_thread,), Int64)
        rCommitted = cute.make_rmem_tensor((self.rows_per_thread,), Int32)
        rCos = cute.make_rmem_tensor((self.rows_per_thread, CHUNK), Float32)
        rSin = cute.make_rmem_tensor((self.rows_per_thread, CHUNK), Float32)
        self.row_inputs(mPos, mLoc, mCommit, width, tile_m, tidx, rSlot, rPos, rCommitted)
        rBias = cute.make_rmem_tensor((2, CHUNK), BFloat16)
        rNorm = cute.make_rmem_tensor((2, CHUNK), self.norm_dtype)
        self.column_inputs(mBias, mNormW, tile_n, tidx, rBias, rNorm)
        return rSlot, rPos, rCommitted, rCos, rSin, rBias, rNorm

    def epilogue_thread(self, tidx: Int32) -> tuple:
        """The epilogue's thread mapping: (lane in the head, head in the tile, first row)."""
        lane_in_head = tidx % self.lanes_per_head
        head = (tidx // self.lanes_per_head) % self.heads_per_tile
        return lane_in_head, head, tidx // (self.lanes_per_head * self.heads_per_tile)

    @cute.jit
    def row_inputs(self, mPos: cute.Tensor, mLoc: cute.Tensor, mCommit: cute.Tensor | None,
                   width: Int32, tile_m: Int32, tidx: Int32, rSlot: cute.Tensor,
                   rPos: cute.Tensor, rCommitted: cute.Tensor) -> None:
        """Slot, position and commit length of each row this thread finishes, loaded before
        the main loop so that the three DRAM round trips land while it runs. Nothing here
        uses a loaded value (the validity test waits for the epilogue), so no load stalls the
        weight stream's issue."""
        _, _, row_first = self.epilogue_thread(tidx)
        for it in cutlass.range_constexpr(self.rows_per_thread):
            token = tile_m * self.bm + cutlass.min(row_first + it * self.row_step, self.bm - 1)
            t = cutlass.select_(token < mLoc.shape[0], token, Int32(0))
            rSlot[it] = mLoc[t]
            rPos[it] = mPos[t]  # in range; a skipped row's own position is never used
            if const_expr(self.has_commit):
                req = t // width
                rCommitted[it] = mCommit[req] - (t - req * width)  # > 0: the row commits

    @cute.jit
    def row_valid(self, it: int, tile_m: Int32, row_first: Int32, num_tokens: Int32,
                  rSlot: cute.Tensor, rCommitted: cute.Tensor) -> Boolean:
        """Whether thread row ``it`` is stored: in the tile and below T, a non-negative slot,
        and with ``cache_loc_2d`` below its request's commit length."""
        row = row_first + it * self.row_step
        valid = (row < self.bm) & (tile_m * self.bm + row < num_tokens) & (rSlot[it] >= 0)
        if const_expr(self.has_commit):
            valid = valid & (rCommitted[it] > 0)
        return valid

    @cute.jit
    def rope_inputs(self, mCosSin: cute.Tensor, tile_m: Int32, is_k: Boolean,
                    num_tokens: Int32, tidx: Int32, rSlot: cute.Tensor, rPos: cute.Tensor,
                    rCommitted: cute.Tensor, rCos: cute.Tensor, rSin: cute.Tensor) -> None:
        """The cos/sin halves of each K row's table row (row 0 for a row that is not
        stored), loaded as soon as the positions are in: before a split tile's hand-over,
        whose round trips then hide them. First, in K and V tiles alike, a row whose position
        lies outside the table gets slot -1: it is not stored (no read or write leaves its
        tensor)."""
        half = self.head_dim // 2
        lane_in_head, _, row_first = self.epilogue_thread(tidx)
        for it in cutlass.range_constexpr(self.rows_per_thread):
            in_table = (rPos[it] >= 0) & (rPos[it] < Int64(mCosSin.shape[0]))
            rSlot[it] = cutlass.select_(in_table, rSlot[it], Int64(-1))
        if is_k:
            for it in cutlass.range_constexpr(self.rows_per_thread):
                valid = self.row_valid(it, tile_m, row_first, num_tokens, rSlot, rCommitted)
                gCS = mCosSin[cutlass.select_(valid, rPos[it], Int64(0)), None]
                cute.autovec_copy(cute.local_tile(gCS, (CHUNK,), (lane_in_head,)), rCos[it, None])
                cute.autovec_copy(
                    cute.local_tile(gCS, (CHUNK,), ((half + lane_in_head * CHUNK) // CHUNK,)),
                    rSin[it, None],
                )

    @cute.jit
    def column_inputs(self, mBias: cute.Tensor | None, mNormW: cute.Tensor, tile_n: Int32,
                      tidx: Int32, rBias: cute.Tensor, rNorm: cute.Tensor) -> None:
        """This thread's bias values and norm weights of both halves (``(2, CHUNK)``, the same
        for every row it finishes), loaded before the main loop like the row metadata: a cold
        DRAM round trip the epilogue would otherwise wait for after the last split arrives.
        Kept in their own dtypes (converted in the epilogue), so nothing waits for them here."""
        half = self.head_dim // 2
        lane_in_head, head, _ = self.epilogue_thread(tidx)
        col_lo = head * self.head_dim + lane_in_head * CHUNK  # tile column of the first half
        layer, _ = self.tile_layer(tile_n)
        for h in cutlass.range_constexpr(2):
            if const_expr(self.has_bias):
                gb = cute.local_tile(
                    mBias, (CHUNK,), ((tile_n * self.bn + col_lo + h * half) // CHUNK,)
                )
                cute.autovec_copy(gb, rBias[h, None])
            gn = cute.local_tile(mNormW[layer, None], (CHUNK,),
                                 ((lane_in_head * CHUNK + h * half) // CHUNK,))
            cute.autovec_copy(gn, rNorm[h, None])

    @cute.jit
    def epilogue(
        self,
        sC: cute.Tensor,
        eps: Float32,
        num_tokens: Int32,
        k_caches: tuple,
        v_caches: tuple,
        tile_m: Int32,
        tile_n: Int32,
        tidx: Int32,
        rSlot: cute.Tensor,
        rCommitted: cute.Tensor,
        rCos: cute.Tensor,
        rSin: cute.Tensor,
        rBias: cute.Tensor,
        rNorm: cute.Tensor,
        row_lo: Int32,
        row_hi: Int32,
    ) -> None:
        """Rows ``[row_lo, row_hi)`` of the staged fp32 tile -> cache rows (row metadata,
        bias, norm weights and cos/sin prefetched)."""
        half = self.head_dim // 2
        lane_in_head, head, row_first = self.epilogue_thread(tidx)
        col_lo = head * self.head_dim + lane_in_head * CHUNK  # tile column of the first half
        _, is_k, base, row_bytes, slots = self.tile_destination(tile_n, k_caches, v_caches,
                                                                col_lo)
        rBiasF = cute.make_rmem_tensor((2 * CHUNK,), Float32)
        rNormF = cute.make_rmem_tensor((2 * CHUNK,), Float32)
        for h in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(CHUNK):
                if const_expr(self.has_bias):
                    rBiasF[h * CHUNK + i] = rBias[h, i].to(Float32)
                rNormF[h * CHUNK + i] = rNorm[h, i].to(Float32)

        inv_d = Float32(1.0 / self.head_dim)  # exact: D is a power of two
        rAcc = cute.make_rmem_tensor((CHUNK,), Float32)
        rY = cute.make_rmem_tensor((2 * CHUNK,), Float32)
        rOut = cute.make_rmem_tensor((CHUNK // 2,), Uint32)
        for it in cutlass.range_constexpr(self.rows_per_thread):
            # more thread rows than tile rows (row_step > bm): the extra ones compute row 0
            # again and store nothing
            own = row_first + it * self.row_step
            row = cutlass.min(own, self.bm - 1)
            valid = self.row_valid(it, tile_m, row_first, num_tokens, rSlot, rCommitted)
            # a slot past the cache's last row is not stored either
            valid = valid & (own >= row_lo) & (own < row_hi) & (rSlot[it] < slots)
            for h in cutlass.range_constexpr(2):
                col = (col_lo + h * half) // CHUNK
                cute.autovec_copy(cute.local_tile(sC[row, None], (CHUNK,), (col,)), rAcc)
                for i in cutlass.range_constexpr(CHUNK):
                    rY[h * CHUNK + i] = r1(
                        rAcc[i], rBiasF[h * CHUNK + i] if const_expr(self.has_bias) else None
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
                    rY[i] = r2(rY[i], rstd, rNormF[i])
                for i in cutlass.range_constexpr(CHUNK):
                    rY[i], rY[CHUNK + i] = neox_rotate(rY[i], rY[CHUNK + i], rCos[it, i],
                                                       rSin[it, i])

            if valid:
                row_addr = base + Int64(rSlot[it]) * row_bytes
                for h in cutlass.range_constexpr(2):
                    for w in cutlass.range_constexpr(CHUNK // 2):
                        rOut[w] = du.pack_bf16x2(  # R3 (K) / exact (V)
                            rY[h * CHUNK + 2 * w], rY[h * CHUNK + 2 * w + 1]
                        )
                    du.store_words(row_addr + h * half * 2, rOut)
