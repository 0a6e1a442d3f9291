"""What both C128 cores share: the walk of a range of tokens, the pooling arithmetic (plain
functions, so that both cores pool in the same order and write the same bytes), the record's
norm, quantisation, rotation and store, and the launch."""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32, const_expr

from .. import dsl_utils as du
from ..layouts import C128_RATIO, C128_STATE_BLOCK, HEAD_DIM, NOPE_DIM, CacheFormat

GROUP = CacheFormat.V4_PACKED.group  # 64 dims: one UE8M0 group, one CTA of the cluster
LOG2_E = 1.4426950408889634


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
    one warp per UE8M0 group of 64 dims; and the launch, as both kernels take the same
    arguments (a core sets ``CLUSTER``, ``THREADS``, ``CTAS_PER_SM`` and its ``kernel``)."""

    GROUPS = HEAD_DIM // GROUP  # 8 groups of 64 dims; the last one is the 64 RoPE dims
    WARPS = 8  # pooling warps
    SCAN_AHEAD = 4  # chunks whose positions the walk tests at once
    CLUSTER = 1  # CTAs per launch unit: a cluster launch of this size when > 1
    THREADS = 32 * WARPS  # per CTA
    CTAS_PER_SM = 1

    def __init__(self, fmt: CacheFormat) -> None:
        self.fmt = fmt  # the norm weight's dtype only changes the argument type, not the body

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
        num_units: Int32,
        stream: cuda.CUstream,
    ) -> None:
        """Launch ``num_units`` clusters of ``CLUSTER`` CTAs (the cluster core) or CTAs (the
        stream core); the cache goes to the kernel as bytes."""
        self.kernel(
            mState, mBlockTable, mTokenReq, mPos, mSlot, mNormW, eps, mCosSin,
            du.byte_view(mCache), mKvSlot, mScale, num_units,
        ).launch(
            grid=[num_units * self.CLUSTER, 1, 1],
            block=[self.THREADS, 1, 1],
            cluster=[self.CLUSTER, 1, 1] if self.CLUSTER > 1 else None,
            stream=stream,
            min_blocks_per_mp=self.CTAS_PER_SM,
            # percent of the SM's 228 KiB: the state ring takes (nearly) all of it, and the
            # state copies bypass L1 (cp.async.cg, TMA), so L1 needs little
            preferred_smem_carveout=100,
        )

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
