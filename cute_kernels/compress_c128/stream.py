"""The stream core of ``compress_c128``: one CTA per window on every SM, whole state pages
copied by the TMA unit into an mbarrier ring, for calls of 31+ tokens
(:func:`.interface.core_for`)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32, const_expr

from .. import dsl_utils as du
from ..layouts import C128_RATIO, C128_STATE_BLOCK, C128_STATE_WIDTH, ROPE_DIM, CacheFormat
from .base import (
    C128Core,
    TokenRange,
    group_sum_of_squares,
    merge_triples,
    pooled_value,
    softmax_triple,
)


class CompressC128Stream(C128Core):
    """One CTA per window, every SM at work: for calls with many windows.

    A window is 16 whole state pages of 32 KiB (8 rows of kv | score, contiguous). A producer
    warp walks the CTA's contiguous range of tokens (:class:`C128Core`), reads a boundary
    token's 16 page ids at once (lanes 0..15) and has its lane 0 copy each page with one
    bulk copy of the TMA unit into a ring of ``RING`` page slots, each slot an mbarrier pair
    (full: the copy's bytes arrived; empty: the 256 pooling threads are done with it), running
    ahead across windows and token chunks; it hands each window's start and record slot to the
    pooling warps through a queue in shared memory, and ends the stream with an empty slot
    whose queue entry is -1. The 8 pooling warps own 2 columns a thread (thread ``t``:
    columns ``2t, 2t + 1``, so warp ``w`` owns UE8M0 group ``w``): each page pair's rows
    are read to registers (a warp's loads 256 contiguous bytes), the slots released, and
    pooled in the cluster core's order (:func:`softmax_triple`, :func:`merge_triples`,
    :func:`pooled_value`); the groups' sums of squares meet in shared memory behind a named
    barrier, and each warp stores its group of the record. No cluster: the grid is one CTA
    per SM (all 132 on the H200, where 8-CTA clusters hold 120), and no window waits for
    another CTA.
    """

    CTAS_PER_SM = 1
    # 6 pages (192 KiB) in flight per SM: the cluster core's two CTAs x 1.5 windows of 64 KiB.
    RING = 6
    QUEUE = 4  # windows the producer has started and the pooling warps not yet stored
    PAGE_BYTES = C128_STATE_BLOCK * C128_STATE_WIDTH * 4
    ROW_BYTES = C128_STATE_WIDTH * 4
    PAGES = C128_RATIO // C128_STATE_BLOCK  # 16 pages a window
    THREADS = 32 * (C128Core.WARPS + 1)  # the pooling warps, then the producer
    POOL_BARRIER = 1  # named barrier of the pooling warps (0 is the CTA's)
    # Every page is copied with the L2 evict_first policy: the state is read once, so its lines
    # evict each other (clean) rather than the dirty ones an earlier kernel left, whose
    # write-back would otherwise share the DRAM with the stream. Same-run A/B (H200,
    # 2026-12-04, cold us) against the first window only: all-4096 538.7 -> 529.4, all-512
    # 79.0 -> 77.8, all-128 and mix-256 within 1 % (2026-12-03: the first window against none,
    # all-32 12.8 -> 12.3, all-128 28.4 -> 25.5).

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
        num_ctas: Int32,
    ) -> None:
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        cta, _, _ = cute.arch.block_idx()

        smem = cutlass.memory.SmemAllocator()
        sRing = smem.allocate_tensor(Uint8, cute.make_layout(self.RING * self.PAGE_BYTES),
                                     byte_alignment=128)
        # full barriers of the slots, then their empty barriers
        sBars = smem.allocate_tensor(Int64, cute.make_layout(2 * self.RING), byte_alignment=8)
        # each group's sum of squares, double-buffered by window parity
        sSumSq = smem.allocate_tensor(
            Float32, cute.make_layout((self.GROUPS, 2), stride=(1, self.GROUPS)),
            byte_alignment=16,
        )
        # the started windows' first positions and record slots (-1: no more windows)
        sWindows = smem.allocate_tensor(Int64, cute.make_layout((2, self.QUEUE), stride=(1, 2)),
                                        byte_alignment=16)
        ring = Int32(sRing.iterator.toint())
        bars = Int32(sBars.iterator.toint())
        if warp == 0:
            if lane == 0:
                for s in cutlass.range_constexpr(self.RING):
                    du.mbarrier_init(bars + 8 * s, 1)  # the producer's arrive (and the bytes)
                    du.mbarrier_init(bars + 8 * (self.RING + s), 32 * self.WARPS)
                cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if warp == self.WARPS:
            num_tokens = mPos.shape[0]
            first_token = Int32(Int64(cta) * num_tokens // num_ctas)
            end_token = Int32(Int64(cta + 1) * num_tokens // num_ctas)
            tokens = TokenRange(
                mTokenReq, mBlockTable, mPos, mSlot, mKvSlot, Int32(mState.shape[0]),
                Int64(mCosSin.shape[0]), Int64(mCache.shape[0]) * Int64(mCache.shape[1]),
                first_token, end_token, (end_token - first_token + 31) // 32, lane, Int32(0))
            self.produce(mState, tokens, ring, bars, sWindows, lane)
        else:
            self.pool(ring, bars, sSumSq, sWindows, mNormW, eps, mCosSin, mCache, mScale,
                      warp, lane)

    def slot_of(self, page: Int32) -> tuple:
        """(slot, phase parity) of the ring's ``page``-th page."""
        return page % self.RING, (page // self.RING) % 2

    @cute.jit
    def next_window(self, tokens: TokenRange, chunk: Int32, mask: Uint32, request: Int32,
                    window_start: Int64, kv_slot: Int64) -> tuple:
        """The walk moved past chunks whose boundary tokens are all issued (``mask`` empty) to
        the next one that has one (its :meth:`boundary_lanes` values), or to the last chunk."""
        while (mask == Uint32(0)) & (chunk + 1 < tokens.num_chunks):
            ahead = self.chunks_ahead(tokens, chunk)
            if ahead == Uint32(0):
                chunk = cutlass.min(chunk + self.SCAN_AHEAD, tokens.num_chunks - 1)
            else:
                chunk = chunk + 1 + self.lowest_lane(ahead)
                mask, request, window_start, kv_slot = self.boundary_lanes(tokens, chunk)
        return chunk, mask, request, window_start, kv_slot

    @cute.jit
    def produce(self, mState: cute.Tensor, tokens: TokenRange, ring: Int32, bars: Int32,
                sWindows: cute.Tensor, lane: Int32) -> None:
        """The producer warp: every window of the CTA's tokens, page by page into the ring."""
        mask, request, window_start, kv_slot = self.boundary_lanes(tokens, Int32(0))
        chunk, mask, request, window_start, kv_slot = self.next_window(
            tokens, Int32(0), mask, request, window_start, kv_slot)
        state = mState.iterator.toint()
        page_stride = Int64(mState.stride[0]) * 4
        evict_first = du.evict_first_policy()  # once per thread (see there)
        pages = Int32(0)
        windows = Int32(0)
        while mask != Uint32(0):
            src = self.lowest_lane(mask)
            window_request = cute.arch.shuffle_sync(request, offset=src)
            start = cute.arch.shuffle_sync(window_start, offset=src)
            record = cute.arch.shuffle_sync(kv_slot, offset=src)
            page_id = Int32(0)
            if lane < self.PAGES:  # the window's 16 page ids in one round trip
                page_id = self.page_of(tokens, window_request, start, lane)
            if lane == 0:  # released to the pooling warps by the first page's arrive
                sWindows[0, windows % self.QUEUE] = start
                sWindows[1, windows % self.QUEUE] = record
            for p in cutlass.range_constexpr(self.PAGES):
                page = cute.arch.shuffle_sync(page_id, offset=p)
                slot, phase = self.slot_of(pages)
                du.mbarrier_wait(bars + 8 * (self.RING + slot), phase ^ 1)
                if lane == 0:
                    full = bars + 8 * slot
                    du.mbarrier_arrive_expect_tx(full, self.PAGE_BYTES)
                    dst = ring + slot * self.PAGE_BYTES
                    src_page = state + Int64(page) * page_stride
                    du.cp_async_bulk_g2s(dst, src_page, self.PAGE_BYTES, full, evict_first)
                pages = pages + 1
            windows = windows + 1
            chunk, mask, request, window_start, kv_slot = self.next_window(
                tokens, chunk, mask & (mask - Uint32(1)), request, window_start, kv_slot)
        # the end of the stream: a slot with no bytes, its queue entry -1
        slot, phase = self.slot_of(pages)
        du.mbarrier_wait(bars + 8 * (self.RING + slot), phase ^ 1)
        if lane == 0:
            sWindows[1, windows % self.QUEUE] = Int64(-1)
            du.mbarrier_arrive(bars + 8 * slot)

    def read_rows(self, ring: Int32, page: Int32, thread: Int32, parity: int) -> list:
        """This thread's 2 columns of rows ``parity``, ``parity + 2``, ``+ 4``, ``+ 6`` of the
        ring's ``page``-th page, each as ``(kv0, kv1, score0, score1)`` (a warp's loads: 256
        contiguous bytes each)."""
        slot, _ = self.slot_of(page)
        base = ring + slot * self.PAGE_BYTES + 8 * thread
        rows = []
        for i in range(C128_STATE_BLOCK // 2):
            row = base + (2 * i + parity) * self.ROW_BYTES
            kv = du.load_shared_f32x2(row)
            score = du.load_shared_f32x2(row + self.ROW_BYTES // 2)
            rows.append((kv[0], kv[1], score[0], score[1]))
        return rows

    @cute.jit
    def pool(self, ring: Int32, bars: Int32, sSumSq: cute.Tensor, sWindows: cute.Tensor,
             mNormW: cute.Tensor, eps: Float32, mCosSin: cute.Tensor, mCache: cute.Tensor,
             mScale: cute.Tensor | None, warp: Int32, lane: Int32) -> None:
        """A pooling warp: the windows in the producer's order until the end of the stream."""
        thread = 32 * warp + lane
        norm_w = cute.make_rmem_tensor((2,), Float32)
        for c in cutlass.range_constexpr(2):
            norm_w[c] = mNormW[2 * thread + c].to(Float32)
        fp8_inv_scale = Float32(1.0)
        if const_expr(self.fmt is CacheFormat.FP8):
            fp8_inv_scale = du.div_rn(Float32(1.0), mScale[0])
        pages = Int32(0)
        window = Int32(0)
        running = Int32(1)
        while running != Int32(0):
            slot, phase = self.slot_of(pages)
            du.mbarrier_wait(bars + 8 * slot, phase)  # the window's first page, or the end
            kv_slot = sWindows[1, window % self.QUEUE]
            if kv_slot < Int64(0):
                running = Int32(0)
            else:
                start = sWindows[0, window % self.QUEUE]
                cos_sin = cute.make_rmem_tensor((2,), Float32)
                cos_sin.fill(0.0)
                if warp == self.GROUPS - 1:  # the RoPE pair's cos/sin, in flight meanwhile
                    cos_sin[0] = mCosSin[start, lane]
                    cos_sin[1] = mCosSin[start, ROPE_DIM // 2 + lane]
                pairs: list[list] = [[], []]
                for k in cutlass.range_constexpr(self.PAGES // 2):
                    # page pair k, as the cluster core's warp k holds it: half-warp h the rows
                    # h, h + 2, h + 4, h + 6 of each page (read one parity at a time: fewer
                    # registers live)
                    for p in cutlass.range_constexpr(2):
                        if const_expr(k > 0 or p > 0):  # the first page: waited for above
                            slot, phase = self.slot_of(pages + p)
                            du.mbarrier_wait(bars + 8 * slot, phase)
                    halves: list[list] = [[], []]
                    for h in cutlass.range_constexpr(2):
                        rows = (self.read_rows(ring, pages, thread, h)
                                + self.read_rows(ring, pages + 1, thread, h))
                        for c in cutlass.range_constexpr(2):
                            halves[c].append(softmax_triple([r[c] for r in rows],
                                                            [r[2 + c] for r in rows]))
                    for p in cutlass.range_constexpr(2):  # both pages read: release them
                        slot, _ = self.slot_of(pages + p)
                        du.mbarrier_arrive(bars + 8 * (self.RING + slot))
                    pages = pages + 2
                    for c in cutlass.range_constexpr(2):
                        pairs[c].append(merge_triples(halves[c][0], halves[c][1]))
                x = cute.make_rmem_tensor((2,), Float32)
                for c in cutlass.range_constexpr(2):
                    x[c] = pooled_value(pairs[c])
                window_parity = window % 2
                sum_sq = group_sum_of_squares(x[0], x[1])
                if lane == 0:
                    sSumSq[warp, window_parity] = sum_sq
                cute.arch.barrier(barrier_id=self.POOL_BARRIER,
                                  number_of_threads=32 * self.WARPS)
                self.normalize_store(x, norm_w, eps, cos_sin, fp8_inv_scale, mCache, sSumSq,
                                     kv_slot, window_parity, warp, lane)
                window = window + 1
