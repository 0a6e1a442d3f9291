"""DeepSeek V4 C128 (heavily compressed attention) compressor, in one launch.

For each token on a 128-position boundary: softmax-pool its request's last 128 state rows into
one 512-dim vector, RMSNorm it, quantise dims 0..447 (UE8M0 fp8, groups of 64), rotate dims
448..511 (GPT-J RoPE at the window's first position) and write one record of the paged compressed
KV cache. Contract: specs/compress_c128.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint8, Uint32, const_expr

from . import dsl_utils as du
from .arch import (
    arch_for,
    device_index,
    max_active_clusters,
    queried_max_active_clusters,
    sm_count,
)
from .compile_cache import KernelCache
from .layouts import (
    C128_FORMATS,
    C128_RATIO,
    C128_STATE_BLOCK,
    C128_STATE_WIDTH,
    CACHE_DTYPES,
    HEAD_DIM,
    NOPE_DIM,
    NORM_DTYPES,
    ROPE_DIM,
    CacheFormat,
    cache_format,
    norm_dtype_name,
)
from .ops import cute_op, skip_launch
from .validation import (
    expect_arg,
    expect_eps,
    expect_fp8_scale,
    expect_index,
    expect_paged_cache_strides,
    expect_positive_int,
    expect_stride_multiple,
    fail,
)

GROUP = CacheFormat.V4_PACKED.group  # 64 dims: one UE8M0 group, one CTA of the cluster
LOG2_E = 1.4426950408889634

#: Byte alignment of each tensor argument: what the kernel is compiled to assume (the fake
#: tensors of :func:`_build`) and what the validation checks, from this one table. 2-byte
#: code pairs and 4-byte bf16 pairs are the widest cache stores.
ALIGN = {"state_cache": 16, "block_table": 4, "token_to_req": 4, "positions": 8,
         "slot_mapping": 8, "norm_weight": 4, "cos_sin_cache": 16, "k_cache": 4,
         "kv_slot_mapping": 8, "fp8_scale": 4}


@dataclasses.dataclass(frozen=True)
class CompressC128Key:
    """Code-changing facts. Token, request, page and block counts, strides, eps and the grid are
    runtime values: one compile serves every batch."""

    cache_format: CacheFormat  # one of C128_FORMATS
    norm_dtype: str  # a NORM_DTYPES name
    arch: str
    core: str = "cluster"  # one of CORES, from the token count (core_for)


#: The two cores (``CompressC128Key.core``): 8-CTA clusters, one window split over a cluster
#: (:class:`CompressC128`), and one CTA per window on every SM (:class:`CompressC128Stream`).
CORES = ("cluster", "stream")
#: Forces a core for every call: ``auto`` (the default), or one of CORES (tests, benchmarks).
CORE_ENV = "CUTE_KERNELS_C128_CORE"
#: Calls of at least this many tokens take the stream core. Fewer tokens hold at most one
#: window per resident cluster (30 on the H200), which the cluster core pools in one round;
#: measured on the H200: specs/compress_c128.md.
STREAM_MIN_TOKENS = 31


def core_for(num_tokens: int) -> str:
    """The core a call of ``num_tokens`` tokens runs (``CORE_ENV`` overrides)."""
    wanted = os.environ.get(CORE_ENV, "auto")
    if wanted == "auto":
        return "stream" if num_tokens >= STREAM_MIN_TOKENS else "cluster"
    if wanted not in CORES:
        fail(CORE_ENV, f"auto or one of {', '.join(CORES)}", repr(wanted))
    return wanted


@dataclasses.dataclass(frozen=True)
class TokenRange:
    """What a walk covers: the index tensors and this cluster's (or stream CTA's) range of
    tokens ``[first, end)``, in chunks of 32 (``num_chunks``), seen from lane ``lane`` of warp
    ``warp``; and the bounds its indices must keep: the state pages, the cos/sin table's rows
    and the record slots of the cache."""

    mTokenReq: cute.Tensor
    mBlockTable: cute.Tensor
    mPos: cute.Tensor
    mSlot: cute.Tensor
    mKvSlot: cute.Tensor
    num_pages: Int32
    num_positions: Int64
    num_records: Int64
    first: Int32
    end: Int32
    num_chunks: Int32
    lane: Int32
    warp: Int32


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


# -- the pooling arithmetic, shared by both cores so that they give the same bits ----------------
# Plain functions (unrolled at trace time). A column's 128 window rows are pooled as 16 groups of
# 8 rows (:func:`softmax_triple`; group (k, h) = rows h, h + 2, h + 4, h + 6 of state pages 2k
# and 2k + 1), the two groups of each page pair merged (:func:`merge_triples`), then the 8 pairs
# (:func:`pooled_value`): the order in which the cluster core's lanes, half-warps and warps meet.


def softmax_triple(kv: list, score: list) -> tuple:
    """(max, sum e, sum kv * e) of one column over the rows given, in their order, with
    ``e = ex2.approx((score - max) * log2 e)``."""
    row_max = score[0]
    for s in score[1:]:
        row_max = cute.arch.fmax(row_max, s)
    exp_sum = Float32(0.0)
    weighted = Float32(0.0)
    for k, s in zip(kv, score, strict=True):
        e = du.exp2_approx((s - row_max) * LOG2_E)
        exp_sum = exp_sum + e
        weighted = weighted + k * e
    return row_max, exp_sum, weighted


def merge_triples(first: tuple, second: tuple) -> tuple:
    """Two (max, sum e, sum kv * e) triples of one column as one, rescaled to the larger max
    (``first``'s terms first in each sum)."""
    merged_max = cute.arch.fmax(first[0], second[0])
    mine = du.exp2_approx((first[0] - merged_max) * LOG2_E)
    theirs = du.exp2_approx((second[0] - merged_max) * LOG2_E)
    return (merged_max, first[1] * mine + second[1] * theirs,
            first[2] * mine + second[2] * theirs)


def pooled_value(triples: list) -> Float32:
    """The pooled value of one column from its page pairs' triples, in order: each rescaled to
    the overall max, summed, and divided with IEEE ``div.rn``."""
    total_max = triples[0][0]
    for t in triples[1:]:
        total_max = cute.arch.fmax(total_max, t[0])
    exp_sum = Float32(0.0)
    weighted = Float32(0.0)
    for t in triples:
        rescale = du.exp2_approx((t[0] - total_max) * LOG2_E)
        exp_sum = exp_sum + t[1] * rescale
        weighted = weighted + t[2] * rescale
    return du.div_rn(weighted, exp_sum)


def group_sum_of_squares(x0: Float32, x1: Float32) -> Float32:
    """The sum of squares of a warp's 64 pooled values (lane ``l``: values ``2l``, ``2l + 1``),
    in every lane: a butterfly, the same order everywhere."""
    sum_sq = x0 * x0 + x1 * x1
    for offset in (16, 8, 4, 2, 1):
        sum_sq = sum_sq + cute.arch.shuffle_sync_bfly(sum_sq, offset=offset)
    return sum_sq


def rstd_of_partials(partial: Float32, eps: Float32) -> Float32:
    """RMSNorm's ``1 / rms`` from the 8 groups' sums of squares held by lanes 0..7 (0 in the
    others): summed by a butterfly in a fixed order, the same bits in every lane."""
    for offset in (4, 2, 1):
        partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=offset)
    total = cute.arch.shuffle_sync(partial, offset=0)
    return du.rsqrt_approx_ftz(total * (1.0 / HEAD_DIM) + eps)


class C128Core:
    """What both cores share: the walk of a contiguous range of tokens in chunks of 32 (a
    warp tests 32 tokens with one load of each index tensor and a ballot lists the boundary
    tokens; chunks are skipped SCAN_AHEAD at a time on their positions alone), the pooling
    arithmetic (the functions above) and the record's norm, quantisation, rotation and store,
    one warp per UE8M0 group of 64 dims."""

    GROUPS = HEAD_DIM // GROUP  # 8 groups of 64 dims; the last one is the 64 RoPE dims
    WARPS = 8  # pooling warps
    SCAN_AHEAD = 4  # chunks whose positions the walk tests at once

    def __init__(self, fmt: CacheFormat) -> None:
        self.fmt = fmt  # the norm weight's dtype only changes the argument type, not the body

    @staticmethod
    def lowest_lane(mask: Uint32) -> Int32:
        return Int32(cute.arch.popc((mask & (Uint32(0) - mask)) - Uint32(1)))


    @cute.jit
    def lane_token(self, tokens: TokenRange, chunk: Int32) -> tuple:
        """This lane's token of chunk ``chunk``, ``tokens.first + 32 chunk + lane``: whether it
        is below ``tokens.end``, and its index, 0 when it is not (a safe index to load)."""
        t = tokens.first + chunk * 32 + tokens.lane
        in_range = t < tokens.end
        return in_range, cutlass.select_(in_range, t, Int32(0))


    @cute.jit
    def boundary_lanes(self, tokens: TokenRange, chunk: Int32) -> tuple:
        """The boundary tokens of chunk ``chunk``: lane ``l`` loads token ``tokens.first + 32
        chunk + l`` if it is below ``tokens.end`` (request, position and both slots at once: one
        round trip) and a ballot lists the boundary lanes. Returns ``mask`` and the lane's
        request, window start and record slot."""
        in_range, t_safe = self.lane_token(tokens, chunk)
        request = tokens.mTokenReq[t_safe]
        pos = tokens.mPos[t_safe]
        slot = tokens.mSlot[t_safe]
        kv_slot = tokens.mKvSlot[t_safe]
        window_start = pos - (C128_RATIO - 1)
        is_boundary = in_range & (slot >= 0) & (kv_slot >= 0) & ((pos + 1) % C128_RATIO == 0)
        # Indices out of range never reach memory: a token whose request, window (its block
        # table entries and cos/sin row) or record slot lies outside its tensor is skipped,
        # and a page id outside the state cache is clamped into it where it is read (garbage
        # in, garbage out, but every read stays in the cache). Every CTA of a cluster decides
        # alike.
        is_boundary = (is_boundary & (kv_slot < tokens.num_records) & (window_start >= 0)
                       & (window_start < tokens.num_positions)
                       & (pos < Int64(tokens.mBlockTable.shape[1]) * C128_STATE_BLOCK)
                       & (request >= 0) & (request < tokens.mBlockTable.shape[0]))
        mask = Uint32(cute.arch.vote_ballot_sync(is_boundary))
        return mask, request, window_start, kv_slot

    @cute.jit
    def page_of(self, tokens: TokenRange, request: Int32, window_start: Int64,
                index: Int32) -> Int32:
        """State page ``index`` (0..15) of the window at ``window_start`` of ``request``,
        clamped into the state cache."""
        page = tokens.mBlockTable[request, Int32(window_start // C128_STATE_BLOCK) + index]
        return cutlass.min(cutlass.max(page, 0), tokens.num_pages - 1)

    @cute.jit
    def chunks_ahead(self, tokens: TokenRange, chunk: Int32) -> Uint32:
        """Bit ``j`` set when chunk ``chunk + 1 + j`` (j < SCAN_AHEAD) holds a position on a
        boundary: the positions of the next SCAN_AHEAD chunks in one round trip, so that a
        chunk with none is skipped without its other loads."""
        ahead = Uint32(0)
        for j in cutlass.range_constexpr(self.SCAN_AHEAD):
            in_range, t_safe = self.lane_token(tokens, chunk + 1 + j)
            pos = tokens.mPos[t_safe]
            on_boundary = in_range & ((pos + 1) % C128_RATIO == 0)
            ahead = ahead | (Uint32(cute.arch.vote_any_sync(on_boundary)) << Uint32(j))
        return ahead

    @cute.jit
    def normalize_store(
        self,
        x: cute.Tensor,
        norm_w: cute.Tensor,
        eps: Float32,
        cos_sin: cute.Tensor,
        fp8_inv_scale: Float32,
        mCache: cute.Tensor,
        sSumSq: cute.Tensor,
        kv_slot: Int64,
        parity: Int32,
        group: Int32,
        lane: Int32,
    ) -> None:
        """The warp that stores group ``group`` of the record, once every group's sum of
        squares is in ``sSumSq[:, parity]`` of this CTA's shared memory: sum them (a fixed
        order: the same bits in every warp and CTA), RMSNorm, then quantise/rotate/store."""
        partial = Float32(0.0)
        if lane < self.GROUPS:
            partial = sSumSq[lane, parity]
        rstd = rstd_of_partials(partial, eps)
        y = cute.make_rmem_tensor((2,), Float32)
        for c in cutlass.range_constexpr(2):
            y[c] = x[c] * rstd * norm_w[c]
        self.store(y, cos_sin, fp8_inv_scale, mCache, kv_slot, group, lane)


    @cute.jit
    def store(
        self,
        y: cute.Tensor,
        cos_sin: cute.Tensor,
        fp8_inv_scale: Float32,
        mCache: cute.Tensor,
        kv_slot: Int64,
        group: Int32,
        lane: Int32,
    ) -> None:
        """One warp writes group ``group`` (64 dims) of the record; lane ``l`` owns dims
        ``64 group + 2l, + 1`` — for group 7 exactly GPT-J pair ``l``, rotated by ``cos_sin``
        (the window start's); ``fp8_inv_scale`` is the fp8 cache's ``1 / fp8_scale``."""
        block_size = Int64(mCache.shape[1])
        page_index = kv_slot // block_size
        row = kv_slot - page_index * block_size
        page = mCache.iterator.toint() + page_index * mCache.stride[0]
        is_rope = group == self.GROUPS - 1
        if is_rope:  # rotate the fp32 normed values (not bf16-rounded) at the window start
            y[0], y[1] = du.rotate_pair(y[0], y[1], cos_sin[0], cos_sin[1])
        if const_expr(self.fmt is CacheFormat.V4_PACKED):
            record = page + row * self.fmt.data_bytes
            scale_row = page + block_size * self.fmt.data_bytes + row * self.fmt.scale_bytes
            if is_rope:
                dst = record + NOPE_DIM + 4 * lane
                ptr = cute.make_ptr(Uint32, dst, cute.AddressSpace.gmem, assumed_align=4)
                ptr.store(du.pack_bf16x2(y[0], y[1]))
                if lane == 0:
                    pad = cute.make_ptr(Uint8, scale_row + 7, cute.AddressSpace.gmem)
                    pad.store(Uint8(0))
            else:
                q0 = du.round_to_bf16(y[0])
                q1 = du.round_to_bf16(y[1])
                amax = cute.arch.fmax(abs(q0), abs(q1))
                for offset in (16, 8, 4, 2, 1):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
                exponent = du.ue8m0_exponent(amax)
                inv_scale = du.exp2_neg(exponent)
                codes = du.pack_e4m3x4(q0 * inv_scale, q1 * inv_scale, Float32(0), Float32(0))
                dst = record + group * GROUP + 2 * lane
                ptr = cute.make_ptr(cutlass.Uint16, dst, cute.AddressSpace.gmem, assumed_align=2)
                ptr.store(cutlass.Uint16(codes & Uint32(0xFFFF)))
                if lane == 0:
                    scale = cute.make_ptr(Uint8, scale_row + group, cute.AddressSpace.gmem)
                    scale.store(Uint8(du.ue8m0_byte(exponent)))
        else:
            row_start = page + row * mCache.stride[1]
            if const_expr(self.fmt is CacheFormat.BF16):
                dst = row_start + 2 * (group * GROUP + 2 * lane)
                ptr = cute.make_ptr(Uint32, dst, cute.AddressSpace.gmem, assumed_align=4)
                ptr.store(du.pack_bf16x2(y[0], y[1]))
            else:
                q0 = du.mul_rn(du.round_to_bf16(y[0]), fp8_inv_scale)
                q1 = du.mul_rn(du.round_to_bf16(y[1]), fp8_inv_scale)
                codes = du.pack_e4m3x4(q0, q1, Float32(0), Float32(0))
                dst = row_start + group * GROUP + 2 * lane
                ptr = cute.make_ptr(cutlass.Uint16, dst, cute.AddressSpace.gmem, assumed_align=2)
                ptr.store(cutlass.Uint16(codes & Uint32(0xFFFF)))




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

    @cute.jit
    def __call__(
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
        stream: cuda.CUstream,
    ) -> None:
        self.kernel(
            mState, mBlockTable, mTokenReq, mPos, mSlot, mNormW, eps, mCosSin,
            du.byte_view(mCache), mKvSlot, mScale, num_clusters,
        ).launch(
            grid=[num_clusters * self.CLUSTER, 1, 1],
            block=[32 * self.WARPS, 1, 1],
            cluster=[self.CLUSTER, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.CTAS_PER_SM,
            # percent of the SM's 228 KiB: two CTAs of ~103 KiB (the ring + stats); the state
            # stream bypasses L1 (cp.async.cg), so L1 needs little
            preferred_smem_carveout=100,
        )

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
    # A CTA's first window is read with the L2 evict_first policy (the cluster core's reason:
    # 132 windows, 66 MiB, about the L2's size, replace the state's own clean lines rather than
    # the dirty ones an earlier kernel left); the later windows without a hint. Same-run A/B
    # (H200, 2026-12-03): all-32 12.8 -> 12.3 us, all-128 28.4 -> 25.5, the rest within 1 %.
    EVICT_FIRST_WINDOWS = 1

    @cute.jit
    def __call__(
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
        stream: cuda.CUstream,
    ) -> None:
        self.kernel(
            mState, mBlockTable, mTokenReq, mPos, mSlot, mNormW, eps, mCosSin,
            du.byte_view(mCache), mKvSlot, mScale, num_ctas,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.CTAS_PER_SM,
            # the ring takes nearly all of the SM's shared memory; the copies bypass L1
            preferred_smem_carveout=100,
        )

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
                    if windows < self.EVICT_FIRST_WINDOWS:
                        du.cp_async_bulk_g2s(dst, src_page, self.PAGE_BYTES, full,
                                             evict_first)
                    else:
                        du.cp_async_bulk_g2s(dst, src_page, self.PAGE_BYTES, full)
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


def _build(key: CompressC128Key):
    fmt = key.cache_format
    tokens = du.sym()
    state = du.fake_tensor(
        Float32, (du.sym(), C128_STATE_BLOCK, C128_STATE_WIDTH),
        (du.sym_stride(4), C128_STATE_WIDTH, 1), align=ALIGN["state_cache"],
    )
    block_table = du.fake_tensor(Int32, (du.sym(), du.sym()), (du.sym_stride(), 1),
                                 align=ALIGN["block_table"])
    token_req = du.fake_row_major(Int32, (tokens,), align=ALIGN["token_to_req"])
    positions = du.fake_row_major(Int64, (tokens,), align=ALIGN["positions"])
    slots = du.fake_row_major(Int64, (tokens,), align=ALIGN["slot_mapping"])
    norm_w = du.fake_row_major(du.DSL_DTYPES[NORM_DTYPES[key.norm_dtype]], (HEAD_DIM,),
                               align=ALIGN["norm_weight"])
    cos_sin = du.fake_row_major(Float32, (du.sym(), ROPE_DIM), align=ALIGN["cos_sin_cache"])
    cache = du.fake_paged_cache(fmt.dtype, fmt.record_width, ALIGN["k_cache"], ALIGN["k_cache"],
                                align=ALIGN["k_cache"])
    kv_slots = du.fake_row_major(Int64, (tokens,), align=ALIGN["kv_slot_mapping"])
    scale = None
    if fmt is CacheFormat.FP8:
        scale = du.fake_row_major(Float32, (1,), align=ALIGN["fp8_scale"])
    kernel = CompressC128(fmt) if key.core == "cluster" else CompressC128Stream(fmt)
    return du.compile_tvm_ffi(
        kernel, state, block_table, token_req, positions, slots, norm_w, Float32(1e-6), cos_sin,
        cache, kv_slots, scale, Int32(1), du.env_stream(), arch=key.arch,
    )


def _variants(arch: str) -> list[CompressC128Key]:
    return [CompressC128Key(fmt, w, arch, core) for fmt in C128_FORMATS for w in NORM_DTYPES
            for core in CORES]


KERNELS = KernelCache("compress_c128", _build, _variants)

GRID_WAVES = 1  # persistent grid = this many resident sets of clusters


def _grid_clusters(device: torch.device, num_tokens: int) -> int:
    """Clusters in the persistent grid: as many as the GPU holds at once (30 of 8 CTAs on the
    H200, from the driver's occupancy calculator), never more than tokens.

    One resident set, no queued clusters: a queued cluster only starts when a resident one has
    finished its whole share, so a grid even slightly above the resident count runs a tail at a
    fraction of the bandwidth; and a larger grid costs every batch with few windows (each
    cluster scans its share of the tokens). Measured on the H200: specs/compress_c128.md."""
    resident = max_active_clusters(device_index(device), CompressC128.CLUSTER,
                                   CompressC128.CTAS_PER_SM, 32 * CompressC128.WARPS)
    return max(1, min(num_tokens, GRID_WAVES * resident))


def _grid_is_final(device: torch.device) -> bool:
    """Whether :func:`_grid_clusters` answered from the driver's count, which never changes
    (not from the formula it falls back on while the count cannot be queried)."""
    return queried_max_active_clusters(device_index(device), CompressC128.CLUSTER,
                                       CompressC128.CTAS_PER_SM, 32 * CompressC128.WARPS)


def _launch(key: CompressC128Key, args: tuple) -> Callable[[tuple], None]:
    """The launch of every call of the layout of ``args`` (see ``ops.cute_op``): the compiled
    function and the grid (T is part of the layout) are found once; a 1-D view of a scale of
    another shape is made per call (the cache goes as it is: the kernel views it as bytes)."""
    state_cache, _, _, positions, _, _, _, _, k_cache, _, _, fp8_scale = args
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return skip_launch
    fn = KERNELS.get(key)
    device = state_cache.device
    if key.core == "stream":  # one CTA per SM, never more than tokens
        grid = min(num_tokens, sm_count(device) * CompressC128Stream.CTAS_PER_SM)
        final = True
    else:
        grid = _grid_clusters(device, num_tokens)
        final = _grid_is_final(device)
    fp8 = key.cache_format is CacheFormat.FP8
    flat = fp8 and fp8_scale.shape != (1,)

    def launch(args: tuple) -> None:
        (state_cache, block_table, token_to_req, positions, slot_mapping, norm_weight, eps,
         cos_sin_cache, k_cache, kv_slot_mapping, _, fp8_scale) = args
        scale = (fp8_scale.reshape(1) if flat else fp8_scale) if fp8 else None
        fn(
            state_cache, block_table, token_to_req, positions, slot_mapping, norm_weight,
            float(eps), cos_sin_cache, k_cache, kv_slot_mapping, scale,
            grid if final else _grid_clusters(device, num_tokens),
        )

    return launch


@cute_op("compress_c128", mutates_args=("k_cache",), prepare=_launch, env=(CORE_ENV,))
def compress_c128(
    state_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    kv_block_size: int,
    fp8_scale: torch.Tensor | None = None,
) -> CompressC128Key | None:
    """C128 compress + RMSNorm + RoPE + quantise + paged store, one launch (see the module doc).

    Tokens not on a 128-position boundary, with a negative ``slot_mapping`` or
    ``kv_slot_mapping``, or with an index out of range (specs: "Inputs"), write nothing.
    Launches on the current stream with no host sync and no allocation (CUDA-graph safe).
    Contract: specs/compress_c128.md."""
    expect_arg(state_cache, "state_cache", (torch.float32,), 3, ALIGN["state_cache"])
    device = state_cache.device
    if tuple(state_cache.shape[1:]) != (C128_STATE_BLOCK, C128_STATE_WIDTH):
        fail("state_cache",
             f"[num_blocks, {C128_STATE_BLOCK}, {C128_STATE_WIDTH}] (C128: block size 8, "
             f"kv | score of width {HEAD_DIM}, no overlap)", f"shape {tuple(state_cache.shape)}")
    if state_cache.stride(2) != 1 or state_cache.stride(1) != C128_STATE_WIDTH:
        fail("state_cache", f"row stride {C128_STATE_WIDTH} and unit inner stride",
             f"strides {state_cache.stride()}")
    page_floats = C128_STATE_BLOCK * C128_STATE_WIDTH
    if state_cache.shape[0] > 1 and state_cache.stride(0) < page_floats:
        fail("state_cache", f"page stride >= {page_floats} (pages must not overlap)",
             f"strides {state_cache.stride()}")
    expect_stride_multiple(state_cache, "state_cache", [0], ALIGN["state_cache"])

    expect_arg(block_table, "block_table", (torch.int32,), 2, ALIGN["block_table"], device,
               "state_cache")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        fail("block_table", "unit stride along dim 1", f"strides {block_table.stride()}")

    expect_index(positions, "positions", torch.int64, device, "state_cache")
    num_tokens = positions.shape[0]
    for name, t, dtype in (
        ("token_to_req", token_to_req, torch.int32),
        ("slot_mapping", slot_mapping, torch.int64),
        ("kv_slot_mapping", kv_slot_mapping, torch.int64),
    ):
        expect_index(t, name, dtype, device, "state_cache", num_tokens,
                     "one per token, as positions")

    expect_arg(norm_weight, "norm_weight", tuple(NORM_DTYPES.values()), 1,
               ALIGN["norm_weight"], device, "state_cache", sizes={0: HEAD_DIM},
               contiguous=True)
    expect_eps(eps)

    expect_arg(cos_sin_cache, "cos_sin_cache", (torch.float32,), 2, ALIGN["cos_sin_cache"],
               device, "state_cache", sizes={1: ROPE_DIM}, contiguous=True)

    expect_arg(k_cache, "k_cache", CACHE_DTYPES, 3, ALIGN["k_cache"], device, "state_cache")
    fmt = cache_format(k_cache.dtype)
    if k_cache.shape[2] != fmt.record_width:
        fail("k_cache", f"record width {fmt.record_width} for a {k_cache.dtype} cache",
             f"shape {tuple(k_cache.shape)}")
    expect_positive_int(kv_block_size, "kv_block_size")
    if k_cache.shape[1] != kv_block_size:
        fail("kv_block_size", f"k_cache.shape[1] = {k_cache.shape[1]}", kv_block_size)
    expect_paged_cache_strides(k_cache, "k_cache", kv_block_size, fmt.record_width, fmt.packed,
                               ALIGN["k_cache"])

    if fmt is CacheFormat.FP8:
        expect_fp8_scale(fp8_scale, device, "state_cache", ALIGN["fp8_scale"])

    arch = arch_for(device)
    if arch is None:
        return None
    return CompressC128Key(fmt, norm_dtype_name(norm_weight.dtype), arch, core_for(num_tokens))


check_compress_c128 = compress_c128.check

__all__ = ["CompressC128", "CompressC128Key", "CompressC128Stream", "check_compress_c128",
           "compress_c128"]
