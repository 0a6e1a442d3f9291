"""The cluster core of ``compress_c128``: one window split over an 8-CTA cluster, for calls of
few tokens (:func:`.interface.core_for`)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from .. import dsl_utils as du
from ..layouts import C128_RATIO, HEAD_DIM, ROPE_DIM, CacheFormat
from .base import (
    GROUP,
    C128Core,
    TokenRange,
    group_sum_of_squares,
    merge_triples,
    pooled_value,
    softmax_triple,
)


class IssueCursor:
    """The issuing cursor, a loop-carried value: its chunk, the chunk's boundary lanes not yet
    issued whole (``mask``), this lane's window's two state pages, start and record slot, the
    next half to issue, and how many windows it has started (``issued``)."""

    TYPES = (Int32, Uint32, Int32, Int32, Int64, Int64, Int32, Int32)

    def __init__(self, chunk: Int32, mask: Uint32, page0: Int32, page1: Int32,
                 window_start: Int64, kv_slot: Int64, half: Int32, issued: Int32) -> None:
        self.chunk, self.mask, self.page0, self.page1 = chunk, mask, page0, page1
        self.window_start, self.kv_slot, self.half, self.issued = (window_start, kv_slot, half,
                                                                   issued)

    def values(self) -> tuple:
        return (self.chunk, self.mask, self.page0, self.page1, self.window_start, self.kv_slot,
                self.half, self.issued)

    def __extract_mlir_values__(self) -> list:
        return [kind(v).ir_value() for kind, v in zip(self.TYPES, self.values(), strict=True)]

    def __new_from_mlir_values__(self, values: list) -> IssueCursor:
        return IssueCursor(*(kind(v) for kind, v in zip(self.TYPES, values, strict=True)))


class CompressC128(C128Core):
    """A cluster of 8 CTAs per boundary token; CTA ``r`` of the cluster owns columns
    ``[64r, 64r + 64)`` — exactly one UE8M0 group (CTA 7: the 64 RoPE dims).

    Each CTA reads its 64 columns of the 128 window rows (64 KiB) with 16-byte copies: warp ``w``
    covers rows ``16w .. 16w + 15`` = state pages ``2w`` and ``2w + 1`` of the window, a half-warp
    one row, a lane 4 columns. A window is two halves (one state page per warp, 32 KiB per CTA),
    copied by ``cp.async`` into a ring of three half-window slots that each thread reads back
    itself: while a window is pooled, merged and stored, the next window and the first half of
    the one after it are in flight, and the stream never waits for a window to be consumed
    whole. A lane keeps (max, sum e, sum kv * e) per column; half-warps merge through shuffles,
    warps through shared memory. The RMSNorm's sum of squares crosses the cluster through
    distributed shared memory (each CTA stores its one float into every CTA before the cluster
    barrier; each sums the 8 in rank order, so every CTA gets the same bits); everything else
    is CTA-local, so the whole op is one launch.

    The grid is persistent: each of ``num_clusters`` clusters owns a contiguous range of the
    tokens and walks it in chunks of 32 (:class:`C128Core`), so a token that is not on a
    boundary costs a fraction of one load, and no CTA is launched per token. Only the issuing
    cursor walks the tokens (reading each boundary lane's page ids, all 32 in parallel); it
    runs three halves ahead across chunk ends and hands each window it starts (its first
    position and record slot) to the pooling cursor through shared memory.
    """

    CLUSTER = C128Core.GROUPS  # 8 CTAs: one per 64 columns
    # Two CTAs per SM (<= 128 registers: the 64 fp32 of a window fragment stay in registers)
    # keep up to 192 KiB of state loads in flight per SM; more CTAs measured no faster.
    CTAS_PER_SM = 2
    ROWS_PER_WARP = C128_RATIO // C128Core.WARPS  # 16 = two state pages
    COLS_PER_LANE = 4  # one 16-byte load
    ROW_STEPS = ROWS_PER_WARP // 2  # a warp instruction covers two rows (two half-warps)
    HALF_STEPS = ROW_STEPS // 2  # one state page: 4 row steps
    HALF_CHUNKS = 2 * HALF_STEPS  # 16-byte chunks a thread stages per half: 4 kv + 4 score
    # Half-window slots: 96 KiB per CTA, two CTAs in the SM's 228 KiB.
    RING = 3
    QUEUE = 4  # windows the issuing cursor has started and the pooling one not yet stored
    # A cluster's first windows are read with the L2 evict_first policy (du.evict_first_policy):
    # 4 windows of each of 30 clusters (60 MiB, about the L2's size) then replace the state's
    # own lines, not the dirty ones an earlier kernel left (whose write-back shares the DRAM
    # with the stream). Later windows take the DSL's copies without a hint: a larger stream
    # writes those lines back anyway, and the hinted copies measured slower there (PERF.md).
    EVICT_FIRST_WINDOWS = 4

    @cute.kernel
    def kernel(
        self,
        mState: cute.Tensor,
        mBlockTable: cute.Tensor,
        mTokenReq: cute.Tensor,
        mPos: cute.Tensor,
        mSlot: cute.Tensor,
        mNormW: cute.Tensor,
        eps: Float32,
        mCosSin: cute.Tensor,
        mCache: cute.Tensor,
        mKvSlot: cute.Tensor,
        mScale: cute.Tensor | None,
        num_clusters: Int32,
    ) -> None:
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rank = cute.arch.block_idx_in_cluster()
        cluster_id, _, _ = cute.arch.cluster_idx()

        smem = cutlass.memory.SmemAllocator()
        # (max, sum e, sum kv*e) of every warp for the CTA's 64 columns
        stat_layout = cute.make_layout(
            (3, self.WARPS, GROUP), stride=(self.WARPS * GROUP, GROUP, 1)
        )
        sStat = smem.allocate_tensor(Float32, stat_layout, byte_alignment=16)
        # every CTA's sum of squares, double-buffered by window parity: each CTA writes its
        # own into entry [parity, rank] of every CTA of the cluster (its own included)
        sSumSq = smem.allocate_tensor(
            Float32, cute.make_layout((self.CLUSTER, 2), stride=(1, self.CLUSTER)),
            byte_alignment=16,
        )
        # the issued windows' first positions and record slots, for warp 0 (the issuing
        # cursor is at most 3 windows ahead of the pooling one)
        sWindows = smem.allocate_tensor(Int64, cute.make_layout((2, self.QUEUE), stride=(1, 2)),
                                        byte_alignment=16)
        # The ring of half windows: 16-byte chunk c of thread i in slot s at
        # ((s * HALF_CHUNKS + c) * threads + i) * 16 bytes, so a warp's 32 chunks are 512
        # contiguous bytes (no bank conflicts either way).
        threads = 32 * self.WARPS
        chunk_floats = threads * self.COLS_PER_LANE
        sRing = smem.allocate_tensor(
            Float32,
            cute.make_layout(
                (self.COLS_PER_LANE, self.HALF_CHUNKS, self.RING, threads),
                stride=(1, chunk_floats, self.HALF_CHUNKS * chunk_floats, self.COLS_PER_LANE),
            ),
            byte_alignment=128,
        )
        tRsR = sRing[None, None, None, warp * 32 + lane]  # this thread's (4, 8, RING) chunks
        # A CTA may write into a peer's shared memory only once the peer has started: every
        # thread arrives here and waits before the pooling cursor (by then the peers have
        # long entered, so the wait is short, and the first copies are already in flight).
        cute.arch.cluster_arrive_relaxed()

        num_tokens = mPos.shape[0]
        # Each cluster owns a contiguous range of tokens, the ranges' lengths within one of
        # each other: a prefill's boundary tokens (one in 128) spread evenly over the clusters
        # (a stride of 30 would give them to the 15 odd ones only), and a warp's 32 token
        # loads are contiguous.
        first_token = Int32(Int64(cluster_id) * num_tokens // num_clusters)
        end_token = Int32(Int64(cluster_id + 1) * num_tokens // num_clusters)
        tokens = TokenRange(
            mTokenReq, mBlockTable, mPos, mSlot, mKvSlot, Int32(mState.shape[0]),
            Int64(mCosSin.shape[0]), Int64(mCache.shape[0]) * Int64(mCache.shape[1]),
            first_token, end_token, (end_token - first_token + 31) // 32, lane, warp)
        # -- the issuing cursor: it alone walks the tokens and hands each window it starts to
        # the pooling cursor through sWindows (warp 0 stores the records)
        mask, page0, page1, window_start, kv_slot = self.scan_chunk(tokens, Int32(0))
        # the first chunk may hold no boundary token while a later one does
        cursor = self.skip_empty_chunks(tokens, IssueCursor(
            Int32(0), mask, page0, page1, window_start, kv_slot, Int32(0), Int32(0)))
        g2s = du.cp_async_atom(Float32)
        for first_slot in cutlass.range_constexpr(self.RING):
            cursor = self.issue(g2s, mState, tRsR[None, None, first_slot], sWindows, tokens,
                                cursor, rank)

        # The record's per-lane constants, read once (not on each token's store path) and
        # after the first copies are on their way: the norm weights of dims 64 rank + 2 lane,
        # + 1 and the fp8 cache's reciprocal scale.
        norm_w = cute.make_rmem_tensor((2,), Float32)
        for c in cutlass.range_constexpr(2):
            norm_w[c] = mNormW[rank * GROUP + 2 * lane + c].to(Float32)
        fp8_inv_scale = Float32(1.0)
        if const_expr(self.fmt is CacheFormat.FP8):
            fp8_inv_scale = du.div_rn(Float32(1.0), mScale[0])

        # Every CTA of the cluster has started (see above). A cluster with no window writes
        # into no peer: it leaves without waiting (its arrive needs no matching wait).
        # ``issued`` is cluster-uniform: every CTA walks the same tokens.
        if cursor.issued > Int32(0):
            cute.arch.cluster_wait()

        # -- the pooling cursor: the issued windows in order ----------------------------------
        tKrK = self.make_window_fragment()
        tSrS = self.make_window_fragment()
        ring_slot = Int32(0)
        processed = Int32(0)
        while processed < cursor.issued:
            token_kv_slot = Int64(-1)
            cos_sin = cute.make_rmem_tensor((2,), Float32)
            cos_sin.fill(0.0)
            if warp == 0:
                cute.arch.sync_warp()  # the issuing lane's sWindows entry
                token_start = sWindows[0, processed % self.QUEUE]
                token_kv_slot = sWindows[1, processed % self.QUEUE]
                if rank == self.CLUSTER - 1:
                    # the RoPE pair's cos/sin, in flight through the pooling
                    cos_sin[0] = mCosSin[token_start, lane]
                    cos_sin[1] = mCosSin[token_start, ROPE_DIM // 2 + lane]
            for half in cutlass.range_constexpr(2):
                # Only this thread's own copies are read back: its wait_group is the only
                # sync. The two newer groups (the halves behind this one) stay in flight.
                cute.arch.cp_async_wait_group(self.RING - 1)
                tHsH = tRsR[None, None, ring_slot]
                for i in cutlass.range_constexpr(self.HALF_STEPS):
                    step = half * self.HALF_STEPS + i
                    cute.autovec_copy(tHsH[None, i], tKrK[step, None])
                    cute.autovec_copy(tHsH[None, self.HALF_STEPS + i], tSrS[step, None])
                cursor = self.issue(g2s, mState, tHsH, sWindows, tokens, cursor, rank)
                ring_slot = cutlass.select_(ring_slot == self.RING - 1, Int32(0), ring_slot + 1)
            self.pool_rows(tKrK, tSrS, sStat, warp, lane)
            parity = processed % 2
            x = cute.make_rmem_tensor((2,), Float32)
            if warp == 0:
                self.merge_warps(sStat, sSumSq, x, parity, rank, lane)
                # release: the partial sums written into the peers are visible to them after
                # their wait (and warp 0 is done with sStat before any warp rewrites it)
                cute.arch.cluster_arrive()
            if warp != 0:
                # these warps published nothing: a relaxed arrive orders nothing, so it
                # cannot wait on anything still in flight
                cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
            if warp == 0:
                self.normalize_store(
                    x, norm_w, eps, cos_sin, fp8_inv_scale, mCache, sSumSq, token_kv_slot,
                    parity, rank, lane,
                )
            processed = processed + 1
        # No barrier before exit: no CTA reads a peer's shared memory, and the last writes
        # into this CTA's landed before the last window's wait.

    @cute.jit
    def make_window_fragment(self) -> cute.Tensor:
        """(8 rows, 4 columns) of fp32, a row's 4 columns contiguous: one 16-byte load each."""
        rows_by_cols = cute.make_layout(
            (self.ROW_STEPS, self.COLS_PER_LANE), stride=(self.COLS_PER_LANE, 1)
        )
        return cute.make_rmem_tensor(rows_by_cols, Float32)

    @cute.jit
    def scan_chunk(self, tokens: TokenRange, chunk: Int32) -> tuple:
        """The boundary tokens of chunk ``chunk`` (:meth:`boundary_lanes`: one round trip),
        and each boundary lane reads the two state pages of its window that its warp copies
        (all lanes in parallel: the second round trip). Returns ``mask, page0, page1`` and the
        lane's window start and record slot."""
        mask, request, window_start, kv_slot = self.boundary_lanes(tokens, chunk)
        page0 = Int32(0)
        page1 = Int32(0)
        if (mask >> Uint32(tokens.lane)) & Uint32(1) != Uint32(0):
            page0 = self.page_of(tokens, request, window_start, 2 * tokens.warp)
            page1 = self.page_of(tokens, request, window_start, 2 * tokens.warp + 1)
        return mask, page0, page1, window_start, kv_slot

    @cute.jit
    def skip_empty_chunks(self, tokens: TokenRange, cursor: IssueCursor) -> IssueCursor:
        """``cursor`` moved past chunks whose boundary tokens are all issued (``mask`` empty)
        to the next one that has one (its :meth:`scan_chunk` values), or to the last chunk."""
        chunk, mask, page0, page1, window_start, kv_slot, half, issued = cursor.values()
        while (mask == Uint32(0)) & (chunk + 1 < tokens.num_chunks):
            ahead = self.chunks_ahead(tokens, chunk)
            if ahead == Uint32(0):
                chunk = cutlass.min(chunk + self.SCAN_AHEAD, tokens.num_chunks - 1)
            else:
                chunk = chunk + 1 + self.lowest_lane(ahead)
                mask, page0, page1, window_start, kv_slot = self.scan_chunk(tokens, chunk)
        return IssueCursor(chunk, mask, page0, page1, window_start, kv_slot, half, issued)

    @cute.jit
    def issue(
        self,
        g2s: cute.CopyAtom,
        mState: cute.Tensor,
        tHsH: cute.Tensor,
        sWindows: cute.Tensor,
        tokens: TokenRange,
        cursor: IssueCursor,
        rank: Int32,
    ) -> IssueCursor:
        """The issuing cursor's step: start copying the next half window into ``tHsH`` (this
        lane's 4 columns of kv and score for its 4 rows of one state page: 8 independent 16-byte
        copies), handing a new window's start and record slot to warp 0 through ``sWindows``,
        then advance — past the chunk's last boundary token to the next chunk that has one. One
        commit group per step, empty once every window is issued, so that the pooling cursor's
        ``wait_group`` count is the same at every step."""
        chunk, mask, page0, page1, window_start, kv_slot, half, issued = cursor.values()
        lane = tokens.lane
        if mask != Uint32(0):
            src = self.lowest_lane(mask)
            page = cute.arch.shuffle_sync(cutlass.select_(half == 0, page0, page1), offset=src)
            row_half = lane // 16
            col_tile = rank * (GROUP // self.COLS_PER_LANE) + lane % 16  # 4-column tile index
            score_tile = col_tile + HEAD_DIM // self.COLS_PER_LANE
            # this cluster's window ``issued - half``: its first EVICT_FIRST_WINDOWS go to
            # evict-first L2 lines (see there), the others as copies of the DSL's atom
            if issued - half < self.EVICT_FIRST_WINDOWS:
                self.copy_half(g2s, mState, page, row_half, col_tile, score_tile, tHsH,
                               du.evict_first_policy())
            else:
                self.copy_half(g2s, mState, page, row_half, col_tile, score_tile, tHsH, None)
            if half == 0:
                if tokens.warp == 0 and lane == src:
                    sWindows[0, issued % self.QUEUE] = window_start
                    sWindows[1, issued % self.QUEUE] = kv_slot
                issued = issued + 1
            half = 1 - half
            if half == 0:
                chunk, mask, page0, page1, window_start, kv_slot, half, issued = (
                    self.skip_empty_chunks(tokens, IssueCursor(
                        chunk, mask & (mask - Uint32(1)), page0, page1, window_start, kv_slot,
                        half, issued)).values()
                )
        cute.arch.cp_async_commit_group()
        return IssueCursor(chunk, mask, page0, page1, window_start, kv_slot, half, issued)

    @cute.jit
    def copy_half(self, g2s: cute.CopyAtom, mState: cute.Tensor, page: Int32, row_half: Int32,
                  col_tile: Int32, score_tile: Int32, tHsH: cute.Tensor,
                  policy: Int64 | None) -> None:
        """This lane's 8 copies of a half window (:meth:`issue`): with the L2 cache ``policy``
        when given (inline PTX), else through ``g2s``."""
        for i in cutlass.range_constexpr(self.HALF_STEPS):
            gRow = mState[page, 2 * i + row_half, None]
            gK = cute.local_tile(gRow, (self.COLS_PER_LANE,), (col_tile,))
            gS = cute.local_tile(gRow, (self.COLS_PER_LANE,), (score_tile,))
            sK = tHsH[None, i]
            sS = tHsH[None, self.HALF_STEPS + i]
            if const_expr(policy is None):
                cute.copy(g2s, gK, sK)
                cute.copy(g2s, gS, sS)
            else:
                du.cp_async_16(Int32(sK.iterator.toint()), gK.iterator.toint(), policy)
                du.cp_async_16(Int32(sS.iterator.toint()), gS.iterator.toint(), policy)

    @cute.jit
    def pool_rows(
        self, tKrK: cute.Tensor, tSrS: cute.Tensor, sStat: cute.Tensor, warp: Int32, lane: Int32
    ) -> None:
        """Softmax-pool this lane's 8 rows per column, merge the two half-warps, publish the
        warp's (max, sum e, sum kv * e) for the CTA's 64 columns in shared memory."""
        # -- per-lane softmax pooling over its 8 rows, then merge the two half-warps ----------
        for c in cutlass.range_constexpr(self.COLS_PER_LANE):
            mine = softmax_triple([tKrK[i, c] for i in range(self.ROW_STEPS)],
                                  [tSrS[i, c] for i in range(self.ROW_STEPS)])
            theirs = tuple(cute.arch.shuffle_sync_bfly(v, offset=16) for v in mine)
            merged = merge_triples(mine, theirs)  # lanes < 16 (rows of even parity) first
            if lane < 16:
                col = (lane % 16) * self.COLS_PER_LANE + c
                for q in cutlass.range_constexpr(3):
                    sStat[q, warp, col] = merged[q]
        cute.arch.sync_threads()

    @cute.jit
    def merge_warps(
        self, sStat: cute.Tensor, sSumSq: cute.Tensor, x: cute.Tensor, parity: Int32,
        rank: Int32, lane: Int32,
    ) -> None:
        """Warp 0: merge the 8 warps' triples into the pooled values ``x`` of columns
        ``2 lane, 2 lane + 1`` and write the CTA's sum of squares into ``sSumSq[rank,
        parity]`` of every CTA of the cluster (lane ``p`` into CTA ``p``: remote stores, so
        that after the barrier every CTA reads only its own shared memory)."""
        for c in cutlass.range_constexpr(2):
            col = 2 * lane + c
            x[c] = pooled_value([tuple(sStat[q, k, col] for q in range(3))
                                 for k in range(self.WARPS)])
        sum_sq = group_sum_of_squares(x[0], x[1])
        if lane < self.CLUSTER:
            du.store_peer_f32(Int32((sSumSq.iterator + rank + self.CLUSTER * parity).toint()),
                              lane, sum_sq)
