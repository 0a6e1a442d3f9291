"""Zero-query-head KV insert of DeepSeek V4 / V4.1 (DSpark context insertion).

RoPE (GPT-J pairs on dims 448..511) + quantisation of bf16 ``kv`` rows ``[T, 512]`` into one of
four paged cache formats by resident warps that each keep several slots in flight. Contract:
specs/kv_rope_insert.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, const_expr

from . import dsl_utils as du
from .arch import arch_for, sm_count
from .compile_cache import KernelCache
from .layouts import (
    CACHE_DTYPES,
    HEAD_DIM,
    NOPE_DIM,
    ROPE_DIM,
    VECTOR_BYTES,
    CacheFormat,
    cache_format,
)
from .ops import cute_op, skip_launch
from .validation import (
    expect_arg,
    expect_bool,
    expect_fp8_scale,
    expect_index,
    expect_paged_cache_strides,
    expect_positive_int,
    expect_size,
    fail,
)

#: Byte alignment of each tensor argument: what the kernel is compiled to assume (the fake
#: tensors of :func:`_build`) and what the validation checks, from this one table.
ALIGN = {"kv": VECTOR_BYTES, "k_cache": VECTOR_BYTES, "slot_mapping": 8, "positions": 8,
         "cos_sin_cache": VECTOR_BYTES, "fp8_scale": 4}


#: The most slots a cache may hold: a slot is an int32 in the kernel (2^31 records of 512+
#: bytes would be a 1 TiB cache).
MAX_SLOTS = 2**31 - 1
#: The most rows one call inserts: the kernel counts them in 32 bits, and a warp tests the tokens
#: of its next chunk (up to 64 grid strides ahead) before it knows its item count (2^30 rows of
#: kv would be 1 TiB).
MAX_TOKENS = 2**30


@dataclasses.dataclass(frozen=True)
class KvRopeInsertKey:
    """Everything that changes the generated code. Token count, slot count, page count, block
    size and page/row strides are runtime values: one compile serves them all."""

    cache_format: CacheFormat
    arch: str


class KvRopeInsert:
    """Resident warps striding over the slots, each keeping ``STAGES - 1`` slots' inputs in
    flight while it rotates, quantises and stores the current one (:meth:`slot_loop`): the
    cos/sin row in a ``cp.async`` ring in shared memory, the kv row either there too (the
    packed formats) or in a register ring (bf16 and fp8), the slot in a register ring.
    The slot and position of the warp's next 32 slots are loaded a chunk ahead (one per lane),
    so the cos/sin row of a slot is requested together with its kv row: nothing waits on a
    chain of dependent loads.

    Packed formats: lane ``L`` owns dims ``[16L, 16L + 16)`` (lanes 28..31 the 64 RoPE dims);
    the 32 GPT-J pairs are rotated one per lane in the stage first (:meth:`rotate_rope`), and
    a group max is a butterfly over the lanes of one quantisation group (4 lanes = 64 dims for
    V4, 2 lanes = 32 dims for V4.1). bf16 and fp8: lane ``L`` holds chunks ``L`` and
    ``32 + L`` of the row (each load and store instruction 512 contiguous bytes), and lanes
    24..31, whose second chunks are the RoPE dims, rotate 4 pairs each (:meth:`rotated_rope`).
    """

    WARPS_PER_CTA = 8
    # 32 resident warps x 3 slots ahead keep about 100-120 KiB per SM in flight (a fifth stage,
    # 160 KiB, measured no faster once the quantising formats' instructions were cut). 4 CTAs
    # of 256 threads leave ptxas 64 registers a thread.
    CTAS_PER_SM = 4
    STAGES = 4  # a register ring's row is 8 registers a stage: 4 stages fit 64 registers
    ROW_BYTES = 2 * HEAD_DIM  # the bf16 kv row
    CS_BYTES = 4 * ROPE_DIM  # a cos/sin row: 32 cos then 32 sin (fp32)
    DIMS_PER_LANE = HEAD_DIM // 32  # packed formats
    ROPE_FIRST_LANE = NOPE_DIM // DIMS_PER_LANE  # 28
    CHUNK_DIMS = 8  # bf16 and fp8: lane L holds chunks L and 32 + L, 8 dims each
    HALF_DIMS = 32 * CHUNK_DIMS
    # the RoPE dims are chunks 56..63: the second chunks of lanes 24..31
    CHUNK_ROPE_FIRST_LANE = NOPE_DIM // CHUNK_DIMS - 32
    # Shared memory of an SM on sm_90 and sm_100 is 228 KiB, carved out of the 256 KiB it shares
    # with L1.
    SMEM_BYTES_PER_SM = 228 * 1024

    def __init__(self, fmt: CacheFormat) -> None:
        self.fmt = fmt
        # V4: 64-dim groups over NoPE (lanes 28..31 form a 5th, unused); V4.1: 32-dim groups
        # over all 512 dims.
        self.group_lanes = fmt.group // self.DIMS_PER_LANE
        self.data_bytes = fmt.data_bytes
        self.scale_bytes = fmt.scale_bytes
        # Measured (H200, 2026-12-03): the register ring is 2-3 % faster for fp8 at T >=
        # 65536 and as fast for bf16; the packed formats, whose lanes would hold two
        # quantisation groups each, measured slower on it (V4 by 2-9 %, V4.1 by up to 5 % at
        # T <= 65536: PERF.md).
        self.row_in_ring = fmt.packed
        self.stage_bytes = self.CS_BYTES + (self.ROW_BYTES if self.row_in_ring else 0)
        self.ring_bytes = self.WARPS_PER_CTA * self.STAGES * self.stage_bytes
        # ask for what the resident CTAs' rings need (plus the 1 KiB the driver reserves per
        # CTA) and leave the rest to L1
        self.smem_carveout_percent = -(-100 * self.CTAS_PER_SM * (self.ring_bytes + 1024)
                                       // self.SMEM_BYTES_PER_SM)

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,
        mSlot: cute.Tensor,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mCache: cute.Tensor,
        mScale: cute.Tensor | None,
        grid_ctas: Int32,
        stream: cuda.CUstream,
    ) -> None:
        """``grid_ctas``: min(slots / WARPS_PER_CTA rounded up, SMs x CTAS_PER_SM), from the
        host: every CTA resident at once, and no warp without a slot."""
        self.kernel(mKV, mSlot, mPos, mCosSin, du.byte_view(mCache), mScale).launch(
            grid=[grid_ctas, 1, 1],
            block=[32 * self.WARPS_PER_CTA, 1, 1],
            stream=stream,
            use_pdl=True,  # overlap our launch with the tail of the previous kernel
            min_blocks_per_mp=self.CTAS_PER_SM,
            preferred_smem_carveout=self.smem_carveout_percent,
        )

    @cute.kernel
    def kernel(
        self,
        mKV: cute.Tensor,
        mSlot: cute.Tensor,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mCache: cute.Tensor,
        mScale: cute.Tensor | None,
    ) -> None:
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        sRing = smem.allocate_tensor(Uint8, cute.make_layout(self.ring_bytes), byte_alignment=16)
        ring = Int32(sRing.iterator.toint()) + warp * (self.STAGES * self.stage_bytes)
        # Slot t goes to warp t mod (all warps): at any moment the warps read one contiguous
        # stretch of kv rows (measured 1-2 % faster than contiguous ranges per warp).
        first = cta * self.WARPS_PER_CTA + warp
        stride = num_ctas * self.WARPS_PER_CTA
        # (slot, position) of item 32c + lane: of the next chunk as loaded, and of the chunk
        # being fetched as checked, in 32 bits (the cache holds fewer than 2^31 slots)
        tCrChunk = cute.make_rmem_tensor((2,), Int64)
        tCrItem = cute.make_rmem_tensor((2,), Int32)
        # PDL: nothing before this reads memory the previous kernel may still be writing.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        self.slot_loop(mKV, mSlot, mPos, mCosSin, mCache, mScale, tCrChunk, tCrItem, ring, first,
                       stride, lane)

    @cute.jit
    def slot_loop(
        self, mKV: cute.Tensor, mSlot: cute.Tensor, mPos: cute.Tensor, mCosSin: cute.Tensor,
        mCache: cute.Tensor, mScale: cute.Tensor | None, tCrChunk: cute.Tensor,
        tCrItem: cute.Tensor, ring: Int32, first: Int32, stride: Int32, lane: Int32,
    ) -> None:
        """This warp's items, ``STAGES - 1`` fetched ahead of the one stored. The packed
        formats' kv row goes through the ring, 16 dims a lane; bf16's and fp8's goes global
        -> registers -> global (each lane chunks L and 32 + L; the ring holds the cos/sin
        row). The loop is unrolled by STAGES so that each item's registers (its slot, and its
        row's words where they are in registers) are a static ring index."""
        fp8_scale = Float32(1.0)
        if const_expr(self.fmt is CacheFormat.FP8):
            fp8_scale = mScale[0]
        tCrSlot = cute.make_rmem_tensor((self.STAGES,), Int32)
        tKrK = None if self.row_in_ring else cute.make_rmem_tensor((self.STAGES * 8,), Uint32)
        num_slots = mSlot.shape[0]
        # The first items are tested by their token, not by the item count: its division (and
        # divisor_magic's) need not precede the first loads (ptxas puts the division in the
        # shadow of the chunk's slot/position loads).
        # The packed formats' first kv rows are requested before the chunk's slot/position
        # loads: issued after them, ptxas placed the copies behind those loads' first use, so
        # they waited for the slot round trip (SASS; 4-6 % of a cold T = 2048 call, PERF.md).
        # bf16's and fp8's register loads moved the same way land after that first use
        # entirely (ptxas sinks them), so they stay in fetch.
        if const_expr(self.row_in_ring):
            for ahead in cutlass.range_constexpr(self.STAGES - 1):
                if first + ahead * stride < num_slots:
                    self.copy_row(mKV, ring + ahead * self.stage_bytes, ahead, first, stride,
                                  lane)
        self.load_chunk(mSlot, mPos, tCrChunk, lane, 0, first, stride)
        for ahead in cutlass.range_constexpr(self.STAGES - 1):
            if first + ahead * stride < num_slots:
                self.fetch(mKV, mSlot, mPos, mCosSin, mCache, tCrChunk, tCrItem, tCrSlot, tKrK,
                           ring, ahead, ahead, first, stride, lane, row_copied=True)
            du.cp_async_commit()
        items = cutlass.select_(first < num_slots, (num_slots - 1 - first) // stride + 1, 0)
        # Once per thread, while those copies are in flight: the block size's multiply-shift
        # and fp8's 1 / scale.
        block_magic = du.divisor_magic(Int32(mCache.shape[1]))
        fp8_inv_scale = Float32(1.0)
        if const_expr(self.fmt is CacheFormat.FP8):
            fp8_inv_scale = du.div_rn(Float32(1.0), fp8_scale)
        for base in cutlass.range(0, items, self.STAGES, unroll=1):
            for k in cutlass.range_constexpr(self.STAGES):
                i = base + k
                ahead = i + self.STAGES - 1
                if ahead < items:  # base is a multiple of STAGES: ahead's stage is static
                    self.fetch(mKV, mSlot, mPos, mCosSin, mCache, tCrChunk, tCrItem, tCrSlot,
                               tKrK, ring, (k + self.STAGES - 1) % self.STAGES, ahead, first,
                               stride, lane)
                du.cp_async_commit()  # one group per item: group i is the oldest pending
                if i < items:
                    du.cp_async_wait(self.STAGES - 1)
                    cute.arch.sync_warp()  # every lane's copies are visible
                    stage = ring + k * self.stage_bytes
                    slot = tCrSlot[k]
                    if slot >= 0:  # the same in every lane
                        page, row = self.record_of(mCache, block_magic, slot)
                        if const_expr(self.row_in_ring):
                            self.rotate_rope(stage, lane)
                            cute.arch.sync_warp()  # the rotated pairs are visible to all
                            self.store_packed(stage, self.load_row(stage, lane), page, row,
                                              Int64(mCache.shape[1]), lane,
                                              lane >= self.ROPE_FIRST_LANE)
                        else:
                            tXrW = words(tKrK, 8 * k, 8)
                            row_addr = page + row * mCache.stride[1]
                            if const_expr(self.fmt is CacheFormat.BF16):
                                self.store_bf16(stage, tXrW, row_addr, lane)
                            else:
                                self.store_fp8(stage, tXrW, fp8_inv_scale, row_addr, lane)
                    cute.arch.sync_warp()  # every lane is done with the stage: refill it

    @cute.jit
    def load_row_words(self, mKV: cute.Tensor, tKrK: cute.Tensor, reg_stage: int,
                       item: Int32, first: Int32, stride: Int32, lane: Int32) -> None:
        """Lane L loads chunks L and 32 + L of item ``item``'s kv row (each instruction 512
        contiguous bytes) into register stage ``reg_stage``."""
        row = mKV.iterator.toint() + Int64(first + item * stride) * self.ROW_BYTES
        for half in cutlass.range_constexpr(2):
            words = du.load_global_v4(row + 16 * (32 * half + lane))
            for w in cutlass.range_constexpr(4):
                tKrK[8 * reg_stage + 4 * half + w] = words[w]

    @cute.jit
    def load_row(self, stage: Int32, lane: Int32) -> cute.Tensor:
        """This lane's 16 kv values (dims 16L..16L + 15) from ``stage``, as fp32 (exact)."""
        tXrF = cute.make_rmem_tensor((self.DIMS_PER_LANE,), Float32)
        for half in cutlass.range_constexpr(2):
            words = du.load_shared_v4(self.row_chunk(stage, 2 * lane + half))
            for w in cutlass.range_constexpr(4):
                e = 8 * half + 2 * w
                tXrF[e], tXrF[e + 1] = du.unpack_bf16x2(words[w])
        return tXrF

    @cute.jit
    def copy_chunk_out(self, stage: Int32, chunk: Int32, addr: Int64) -> None:
        """16-byte chunk ``chunk`` of the stage's row to global address ``addr``."""
        words = du.load_shared_v4(self.row_chunk(stage, chunk))
        tXrW = cute.make_rmem_tensor((4,), Uint32)
        for w in cutlass.range_constexpr(4):
            tXrW[w] = words[w]
        du.store_words(addr, tXrW)

    @cute.jit
    def record_of(self, mCache: cute.Tensor, block_magic: tuple,
                  slot: Int32) -> tuple[Int64, Int64]:
        """(page base address, row in the page) of ``slot`` (>= 0, the same in every lane),
        by the block size's 32-bit multiply-shift ``block_magic``
        (:func:`~cute_kernels.dsl_utils.divisor_magic`)."""
        block_size = Int32(mCache.shape[1])
        page_index = du.divide_by_magic(slot, block_magic)
        page = mCache.iterator.toint() + Int64(page_index) * mCache.stride[0]
        return page, Int64(slot - page_index * block_size)

    def row_chunk(self, stage: Int32, chunk: Int32) -> Int32:
        """Where 16-byte chunk ``chunk`` (0..63) of the kv row lives in ``stage``, swizzled:
        the copies write chunks 32h + L (lane L, instruction h: 512 contiguous global bytes
        each) and lane L reads back its chunks 2L and 2L + 1; flipping bit 0 of the 16-byte
        slot in every odd group of 8 chunks keeps both free of shared-memory bank conflicts."""
        return stage + 16 * (chunk ^ ((chunk >> 3) & 1))

    def cos_sin_row(self, stage: Int32) -> Int32:
        """The 256-byte cos/sin row of ``stage`` (32 cos, then 32 sin, fp32), after the kv row
        where the ring holds it."""
        return stage + (self.ROW_BYTES if self.row_in_ring else 0)

    @cute.jit
    def load_chunk(
        self, mSlot: cute.Tensor, mPos: cute.Tensor, tCrChunk: cute.Tensor, lane: Int32,
        chunk_start: Int32, first: Int32, stride: Int32,
    ) -> None:
        """Lane L loads (slot, position) of this warp's item ``chunk_start + L`` into
        ``tCrChunk`` (slot -1 past the warp's last item): plain loads, used when the fetches
        reach that chunk."""
        token = first + (chunk_start + lane) * stride
        tCrChunk[0] = Int64(-1)
        tCrChunk[1] = Int64(0)
        if token < mSlot.shape[0]:
            tCrChunk[0] = mSlot[token]
            tCrChunk[1] = mPos[token]

    @cute.jit
    def copy_row(self, mKV: cute.Tensor, stage: Int32, item: Int32, first: Int32,
                 stride: Int32, lane: Int32) -> None:
        """Item ``item``'s kv row into ``stage`` (each instruction 512 contiguous bytes: whole
        sectors)."""
        row = mKV.iterator.toint() + Int64(first + item * stride) * self.ROW_BYTES
        for half in cutlass.range_constexpr(2):
            chunk = 32 * half + lane
            du.cp_async_16(self.row_chunk(stage, chunk), row + 16 * chunk)

    @cute.jit
    def fetch(
        self, mKV: cute.Tensor, mSlot: cute.Tensor, mPos: cute.Tensor, mCosSin: cute.Tensor,
        mCache: cute.Tensor, tCrChunk: cute.Tensor, tCrItem: cute.Tensor,
        tCrSlot: cute.Tensor, tKrK: cute.Tensor | None, ring: Int32, stage_index: int,
        item: Int32, first: Int32, stride: Int32, lane: Int32, row_copied: bool = False,
    ) -> None:
        """Start the loads of item ``item``'s inputs into stage ``stage_index`` (``item %
        STAGES``, static) of the rings: the kv row into the shared ring where it is held there
        (:meth:`copy_row`, unless the prologue has: ``row_copied``), for a slot that is
        written its cos/sin row, and the row's words into register stage ``stage_index`` of ``tKrK``
        where it is held there. Its slot goes to ``tCrSlot[stage_index]`` (from the chunk
        registers, checked: -1 when the row is skipped), the same in every lane."""
        stage = ring + stage_index * self.stage_bytes
        # the kv row first: its address needs no load (the prologue copies its first rows
        # itself, ahead of the chunk loads)
        if const_expr(self.row_in_ring and not row_copied):
            self.copy_row(mKV, stage, item, first, stride, lane)
        if item % 32 == 0:  # enter the next chunk, and start loading the one after it
            # Input out of range never reaches memory: a slot past the cache's last row, or a
            # position outside the cos/sin table, skips its row as a negative slot does.
            # Tested once per lane and chunk, as the chunk is entered.
            slot_ahead, position_ahead = tCrChunk[0], tCrChunk[1]
            # every negative slot tested here, in 64 bits: one below -2^31 may have low 32
            # bits that are a slot of the cache
            in_range = ((slot_ahead >= 0)
                        & (slot_ahead < Int64(mCache.shape[0]) * Int64(mCache.shape[1]))
                        & (position_ahead >= 0) & (position_ahead < Int64(mCosSin.shape[0])))
            # in [0, the cache's slot count < 2^31 (validated)) or -1: one 32-bit shuffle a slot
            tCrItem[0] = Int32(cutlass.select_(in_range, slot_ahead, Int64(-1)))
            tCrItem[1] = Int32(position_ahead)  # in [0, max_pos) where it is used
            self.load_chunk(mSlot, mPos, tCrChunk, lane, item + 32, first, stride)
        slot = cute.arch.shuffle_sync(tCrItem[0], offset=item % 32)
        position = cute.arch.shuffle_sync(tCrItem[1], offset=item % 32)
        cs_lane = lane - (32 - self.CS_BYTES // 16)
        if (cs_lane >= 0) & (slot >= 0):  # a skipped row's position: any value
            # the 256-byte row as is, by the last 16 lanes in one instruction (whole sectors)
            table = mCosSin.iterator.toint() + Int64(position) * (4 * ROPE_DIM)
            du.cp_async_16(self.cos_sin_row(stage) + 16 * cs_lane, table + 16 * cs_lane)
        tCrSlot[stage_index] = slot
        if const_expr(not self.row_in_ring):
            self.load_row_words(mKV, tKrK, stage_index, item, first, stride, lane)

    @cute.jit
    def rotate_rope(self, stage: Int32, lane: Int32) -> None:
        """Packed formats: lane ``j`` rotates GPT-J pair ``j`` (dims 448 + 2j, + 1) of the
        stage's row with its cos/sin (every lane one pair, where 4 RoPE lanes rotating 8 pairs
        each cost the warp 8 rounds), and writes the result back into the row, bf16 (RNE). The
        caller syncs the warp after."""
        cs = self.cos_sin_row(stage)
        pair_chunk = self.row_chunk(stage, (NOPE_DIM * 2 + 4 * lane) // 16) + 4 * (lane % 4)
        x_even, x_odd = du.unpack_bf16x2(du.load_shared_b32(pair_chunk))
        cos = du.load_shared_b32(cs + 4 * lane, Float32)
        sin = du.load_shared_b32(cs + self.CS_BYTES // 2 + 4 * lane, Float32)
        rot_even, rot_odd = du.rotate_pair(x_even, x_odd, cos, sin)
        du.store_shared_b32(pair_chunk, du.pack_bf16x2(rot_even, rot_odd))

    @cute.jit
    def rotated_rope(self, stage: Int32, tXrW: cute.Tensor, lane: Int32) -> cute.Tensor:
        """bf16 and fp8: a RoPE lane's (24..31) second chunk (words 4..7 of ``tXrW``: dims
        ``256 + 8L ..``, GPT-J pairs ``4(L - 24) ..``) rotated with its cos/sin from
        ``stage``, as 8 fp32."""
        tXrF = cute.make_rmem_tensor((self.CHUNK_DIMS,), Float32)
        for w in cutlass.range_constexpr(4):
            tXrF[2 * w], tXrF[2 * w + 1] = du.unpack_bf16x2(tXrW[4 + w])
        cos = self.cos_sin_row(stage) + 16 * (lane - self.CHUNK_ROPE_FIRST_LANE)
        tCrC = du.load_shared_v4(cos, Float32)
        tCrS = du.load_shared_v4(cos + self.CS_BYTES // 2, Float32)
        for j in cutlass.range_constexpr(4):
            tXrF[2 * j], tXrF[2 * j + 1] = du.rotate_pair(tXrF[2 * j], tXrF[2 * j + 1],
                                                          tCrC[j], tCrS[j])
        return tXrF

    @cute.jit
    def quantize_group(self, tXrF: cute.Tensor, tXrQ: cute.Tensor) -> Int32:
        """UE8M0 quantisation of this lane's 16 values within its group; returns the group's
        exponent ``e`` (codes = e4m3(v * 2^-e)), identical in every lane of the group."""
        amax = du.abs_max(tXrF, self.DIMS_PER_LANE, Float32(0.0))
        offset = 1
        for _ in cutlass.range_constexpr(self.group_lanes.bit_length() - 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
            offset *= 2
        exponent = du.ue8m0_exponent(amax)
        inv_scale = du.exp2_neg(exponent)  # exact power of two: the products are exact
        for w in cutlass.range_constexpr(self.DIMS_PER_LANE // 4):
            tXrQ[w] = du.pack_e4m3x4(
                tXrF[4 * w] * inv_scale,
                tXrF[4 * w + 1] * inv_scale,
                tXrF[4 * w + 2] * inv_scale,
                tXrF[4 * w + 3] * inv_scale,
            )
        return exponent

    @cute.jit
    def store_packed(
        self,
        stage: Int32,
        tXrF: cute.Tensor,
        page: Int64,
        row: Int64,
        block_size: Int64,
        lane: Int32,
        is_rope_lane: cutlass.Boolean,
    ) -> None:
        """Segregated page layout: ``[bs x data_bytes]`` records, then ``[bs x scale_bytes]``."""
        record = page + row * self.data_bytes
        tXrQ = cute.make_rmem_tensor((self.DIMS_PER_LANE // 4,), Uint32)
        # V4.1 quantises the bf16-rounded rotated values too (the RoPE lanes read them back
        # from the stage); V4's group 7 (the RoPE lanes) is never stored.
        exponent = self.quantize_group(tXrF, tXrQ)
        if const_expr(self.fmt is CacheFormat.V41_MXFP8):
            du.store_words(record + lane * self.DIMS_PER_LANE, tXrQ)
        else:
            if not is_rope_lane:
                du.store_words(record + lane * self.DIMS_PER_LANE, tXrQ)
            # the 128 bytes of rotated bf16 RoPE dims leave from the stage as whole sectors
            rope_chunks = ROPE_DIM * 2 // 16
            if lane < rope_chunks:
                self.copy_chunk_out(stage, self.ROW_BYTES // 16 - rope_chunks + lane,
                                    record + NOPE_DIM + 16 * lane)
        # Scale bytes: the first lane of each group stores its group's byte, so the row's
        # scale bytes leave in one store instruction (one sector). (V4: lane 28 owns "group 7",
        # the RoPE lanes, whose byte is the zero pad.)
        scale_byte = du.ue8m0_byte(exponent)
        if const_expr(self.fmt is CacheFormat.V4_PACKED):
            scale_byte = cutlass.select_(is_rope_lane, Int32(0), scale_byte)
        if lane % self.group_lanes == 0:
            scale_row = page + block_size * self.data_bytes + row * self.scale_bytes
            ptr = cute.make_ptr(Uint8, scale_row + lane // self.group_lanes,
                                cute.AddressSpace.gmem)
            ptr.store(Uint8(scale_byte))

    @cute.jit
    def store_bf16(self, stage: Int32, tXrW: cute.Tensor, row_addr: Int64, lane: Int32) -> None:
        """A slot's words (chunks L and 32 + L) to the cache row: each store instruction writes
        512 contiguous bytes; the NoPE dims leave as their input bits, and lanes 24..31 rotate
        the RoPE dims of their second chunk and round them to bf16 (RNE) on the way."""
        if lane >= self.CHUNK_ROPE_FIRST_LANE:
            tXrF = self.rotated_rope(stage, tXrW, lane)
            for w in cutlass.range_constexpr(4):
                tXrW[4 + w] = du.pack_bf16x2(tXrF[2 * w], tXrF[2 * w + 1])
        for half in cutlass.range_constexpr(2):
            du.store_words(row_addr + 16 * (32 * half + lane), words(tXrW, 4 * half, 4))

    @cute.jit
    def store_fp8(self, stage: Int32, tXrW: cute.Tensor, inv_scale: Float32, row_addr: Int64,
                  lane: Int32) -> None:
        """e4m3(clamp(x * inv_scale)), ``inv_scale = fl32(1 / scale)``, from fp32 (the RoPE dims
        are not rounded first); each store instruction writes 256 contiguous bytes."""
        tXrF = cute.make_rmem_tensor((2 * self.CHUNK_DIMS,), Float32)
        for w in cutlass.range_constexpr(8):
            tXrF[2 * w], tXrF[2 * w + 1] = du.unpack_bf16x2(tXrW[w])
        if lane >= self.CHUNK_ROPE_FIRST_LANE:
            tXrR = self.rotated_rope(stage, tXrW, lane)
            for d in cutlass.range_constexpr(self.CHUNK_DIMS):
                tXrF[self.CHUNK_DIMS + d] = tXrR[d]
        for half in cutlass.range_constexpr(2):
            tXrQ = cute.make_rmem_tensor((2,), Uint32)
            for w in cutlass.range_constexpr(2):
                e = self.CHUNK_DIMS * half + 4 * w
                tXrQ[w] = du.pack_e4m3x4(
                    du.mul_rn(tXrF[e], inv_scale),
                    du.mul_rn(tXrF[e + 1], inv_scale),
                    du.mul_rn(tXrF[e + 2], inv_scale),
                    du.mul_rn(tXrF[e + 3], inv_scale),
                )
            du.store_words(row_addr + self.HALF_DIMS * half + self.CHUNK_DIMS * lane, tXrQ,
                           align=8)


def words(tXrW: cute.Tensor, start: int, count: int) -> cute.Tensor:
    """Register words ``[start, start + count)`` of ``tXrW`` as a tensor of their own (what a
    vector store takes; the copies are register renames)."""
    tXrV = cute.make_rmem_tensor((count,), Uint32)
    for w in range(count):  # plain helper: unrolled at trace time
        tXrV[w] = tXrW[start + w]
    return tXrV


def _build(key: KvRopeInsertKey):
    """Tensor-free compile: symbolic token, slot and page counts; 64-bit symbolic strides."""
    fmt = key.cache_format
    tokens = du.sym()
    kv = du.fake_row_major(BFloat16, (tokens, HEAD_DIM), align=ALIGN["kv"])
    slots = du.fake_row_major(Int64, (du.sym(),), align=ALIGN["slot_mapping"])
    positions = du.fake_row_major(Int64, (tokens,), align=ALIGN["positions"])
    cos_sin = du.fake_row_major(Float32, (du.sym(), ROPE_DIM), align=ALIGN["cos_sin_cache"])
    # the cache in its own dtype; the kernel sees it as bytes (du.byte_view)
    cache = du.fake_paged_cache(fmt.dtype, fmt.record_width, VECTOR_BYTES,
                                1 if fmt.packed else VECTOR_BYTES, align=ALIGN["k_cache"])
    scale = None
    if fmt is CacheFormat.FP8:
        scale = du.fake_row_major(Float32, (1,), align=ALIGN["fp8_scale"])
    return du.compile_tvm_ffi(
        KvRopeInsert(fmt), kv, slots, positions, cos_sin, cache, scale, Int32(1),
        du.env_stream(), arch=key.arch,
    )


def _variants(arch: str) -> list[KvRopeInsertKey]:
    return [KvRopeInsertKey(fmt, arch) for fmt in CacheFormat]


KERNELS = KernelCache("kv_rope_insert", _build, _variants)


def _launch(key: KvRopeInsertKey, args: tuple) -> Callable[[tuple], None]:
    """The launch of every call of the layout of ``args`` (see ``ops.cute_op``): the compiled
    function is looked up once; a 1-D view of a scale of another shape is made per call (the
    cache goes as it is: the kernel views it as bytes)."""
    kv, k_cache, slot_mapping, _, _, _, fp8_scale, _ = args
    if slot_mapping.shape[0] == 0:
        return skip_launch
    fn = KERNELS.get(key)
    # every CTA resident at once, and no warp without a slot (KvRopeInsert.__call__)
    one_slot_per_warp = -(-slot_mapping.shape[0] // KvRopeInsert.WARPS_PER_CTA)
    grid_ctas = min(one_slot_per_warp, sm_count(kv.device) * KvRopeInsert.CTAS_PER_SM)
    fp8 = key.cache_format is CacheFormat.FP8
    flat = fp8 and fp8_scale.shape != (1,)

    def launch(args: tuple) -> None:
        kv, k_cache, slot_mapping, positions, cos_sin_cache, _, fp8_scale, _ = args
        scale = (fp8_scale.reshape(1) if flat else fp8_scale) if fp8 else None
        fn(kv, slot_mapping, positions, cos_sin_cache, k_cache, scale, grid_ctas)

    return launch


@cute_op("kv_rope_insert", mutates_args=("k_cache",), prepare=_launch)
def kv_rope_insert(
    kv: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    block_size: int,
    fp8_scale: torch.Tensor | None = None,
    kv_mxfp8: bool = False,
) -> KvRopeInsertKey | None:
    """RoPE + quantise + insert ``kv[:N]`` into the paged ``k_cache`` at ``slot_mapping``.

    Same arguments, in the same order, as vLLM's ``fused_deepseek_v4_kv_rope_insert``.
    ``N = slot_mapping.shape[0]``; negative slots, slots past the cache and positions outside
    ``cos_sin_cache`` are skipped; nothing else is written. Launches
    on the current stream with no host sync or allocation (CUDA-graph safe). Contract:
    specs/kv_rope_insert.md.
    """
    expect_arg(kv, "kv", (torch.bfloat16,), 2, ALIGN["kv"], sizes={1: HEAD_DIM},
               contiguous=True)
    device = kv.device

    expect_arg(k_cache, "k_cache", CACHE_DTYPES, 3, ALIGN["k_cache"], device, "kv")
    mxfp8 = expect_bool(kv_mxfp8, "kv_mxfp8")
    fmt = cache_format(k_cache.dtype, mxfp8)
    expect_positive_int(block_size, "block_size")
    expect_size(k_cache, "k_cache", 1, block_size)
    if k_cache.shape[2] != fmt.record_width:
        fail(
            "k_cache",
            f"record width {fmt.record_width} for a {k_cache.dtype} cache"
            + (f" (kv_mxfp8={mxfp8})" if fmt.packed else ""),
            f"shape {tuple(k_cache.shape)}",
        )
    expect_paged_cache_strides(k_cache, "k_cache", block_size, fmt.record_width, fmt.packed,
                               ALIGN["k_cache"])
    if k_cache.shape[0] * block_size > MAX_SLOTS:
        fail("k_cache", f"at most {MAX_SLOTS} slots (pages x block_size: the kernel keeps a "
             "slot in 32 bits)", f"{k_cache.shape[0]} pages x {block_size}")

    expect_index(slot_mapping, "slot_mapping", torch.int64, device, "kv")
    if slot_mapping.shape[0] > kv.shape[0]:
        fail("slot_mapping", f"at most {kv.shape[0]} entries (kv rows)", slot_mapping.shape[0])
    if slot_mapping.shape[0] > MAX_TOKENS:
        fail("slot_mapping", f"at most {MAX_TOKENS} entries (the kernel counts rows in 32 bits)",
             slot_mapping.shape[0])
    expect_index(positions, "positions", torch.int64, device, "kv", kv.shape[0],
                 "one per kv row")

    expect_arg(cos_sin_cache, "cos_sin_cache", (torch.float32,), 2, ALIGN["cos_sin_cache"],
               device, "kv", sizes={1: ROPE_DIM}, contiguous=True)

    expect_fp8_scale(fp8_scale, device, "kv", ALIGN["fp8_scale"], fmt is CacheFormat.FP8)

    arch = arch_for(device)
    return KvRopeInsertKey(fmt, arch) if arch is not None else None


check_kv_rope_insert = kv_rope_insert.check

__all__ = ["KvRopeInsertKey", "KvRopeInsert", "check_kv_rope_insert", "kv_rope_insert"]
