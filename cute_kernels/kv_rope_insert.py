"""Zero-query-head KV insert of DeepSeek V4 / V4.1 (DSpark context insertion).

RoPE (GPT-J pairs on dims 448..511) + quantisation of bf16 ``kv`` rows ``[T, 512]`` into one of
four paged cache formats, one warp per slot at every token count. Contract: specs/kv_rope_insert.md.
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
from .arch import arch_for
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
from .ops import cute_op
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


@dataclasses.dataclass(frozen=True)
class KvRopeInsertKey:
    """Everything that changes the generated code. Token count, slot count, page count, block
    size and page/row strides are runtime values: one compile serves them all."""

    cache_format: CacheFormat
    arch: str


class KvRopeInsert:
    """One warp per (token, slot); lane ``L`` owns dims ``[16L, 16L + 16)``.

    Lanes 0..27 hold NoPE dims, lanes 28..31 the 64 RoPE dims (8 GPT-J pairs each). A group
    max is a butterfly over the lanes of one quantisation group (4 lanes = 64 dims for V4, 2
    lanes = 32 dims for V4.1). Each lane moves its data with 16-byte vectors, so a warp reads one
    contiguous 1 KiB kv row and writes whole 16-byte sectors of the record.
    """

    WARPS_PER_CTA = 8  # 256 threads: enough CTAs at T = 1 .. 262144 without a tail wave problem
    # The op is bound by how many bytes each SM keeps in flight; a warp holds its loads for one
    # slot only, so throughput scales with resident warps. 8 CTAs x 256 threads = the full 2048
    # threads of an SM, which caps ptxas at 32 registers per thread.
    MIN_CTAS_PER_SM = 8
    DIMS_PER_LANE = HEAD_DIM // 32
    ROPE_FIRST_LANE = NOPE_DIM // DIMS_PER_LANE  # 28
    PAIRS_PER_LANE = DIMS_PER_LANE // 2  # 8 (cos, sin) pairs per RoPE lane

    def __init__(self, fmt: CacheFormat) -> None:
        self.fmt = fmt
        # V4: 64-dim groups over NoPE (lanes 28..31 form a 5th, unused); V4.1: 32-dim groups
        # over all 512 dims.
        self.group_lanes = fmt.group // self.DIMS_PER_LANE
        self.data_bytes = fmt.data_bytes
        self.scale_bytes = fmt.scale_bytes

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,
        mSlot: cute.Tensor,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mCache: cute.Tensor,
        mScale: cute.Tensor | None,
        stream: cuda.CUstream,
    ) -> None:
        num_slots = mSlot.shape[0]
        self.kernel(mKV, mSlot, mPos, mCosSin, mCache, mScale).launch(
            grid=[cute.ceil_div(num_slots, self.WARPS_PER_CTA), 1, 1],
            block=[32 * self.WARPS_PER_CTA, 1, 1],
            stream=stream,
            use_pdl=True,  # overlap our launch with the tail of the previous kernel
            min_blocks_per_mp=self.MIN_CTAS_PER_SM,
            preferred_smem_carveout=0,  # no shared memory: give the SM's unified memory to L1
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
        token = cta * self.WARPS_PER_CTA + warp
        # PDL: nothing before this reads memory the previous kernel may still be writing.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if token < mSlot.shape[0]:
            # The slot, the position and the kv row are independent loads: issue them together
            # so a warp waits for two DRAM round trips (these, then cos/sin), not four.
            slot = mSlot[token]
            position = du.load_i64_now(mPos.iterator.toint() + Int64(token) * 8)
            tXgX = cute.local_tile(mKV[token, None], (self.DIMS_PER_LANE,), (lane,))
            tXrX = cute.make_rmem_tensor((self.DIMS_PER_LANE,), BFloat16)
            cute.autovec_copy(tXgX, tXrX)
            if slot >= 0:
                tXrF = cute.make_rmem_tensor((self.DIMS_PER_LANE,), Float32)
                tXrF.store(tXrX.load().to(Float32))
                is_rope_lane = lane >= self.ROPE_FIRST_LANE
                if is_rope_lane:  # skipped rows may carry any position: read cos/sin only here
                    self.apply_rope(tXrF, mCosSin, position, lane)

                block_size = Int64(mCache.shape[1])
                page_index = slot // block_size
                row = slot - page_index * block_size
                page = mCache.iterator.toint() + page_index * mCache.stride[0]
                if const_expr(self.fmt.packed):
                    self.store_packed(tXrF, page, row, block_size, lane, is_rope_lane)
                else:
                    row_start = page + row * mCache.stride[1]
                    if const_expr(self.fmt is CacheFormat.BF16):
                        row_addr = row_start + lane * (2 * self.DIMS_PER_LANE)
                        self.store_bf16(tXrF, row_addr)
                    else:
                        row_addr = row_start + lane * self.DIMS_PER_LANE
                        self.store_fp8(tXrF, mScale, row_addr)

    @cute.jit
    def apply_rope(
        self, tXrF: cute.Tensor, mCosSin: cute.Tensor, position: Int64, lane: Int32
    ) -> None:
        """GPT-J rotation of this lane's 8 pairs with cos/sin row ``position`` (cos | sin).

        Two rounds of 4 pairs, one 16-byte cos and one 16-byte sin vector each: holding all 16
        cos/sin values next to the 16 data values would not fit the 32 registers that full
        occupancy allows."""
        gCS = mCosSin[position, None]
        first_pair = (lane - self.ROPE_FIRST_LANE) * self.PAIRS_PER_LANE
        tCrC = cute.make_rmem_tensor((4,), Float32)
        tCrS = cute.make_rmem_tensor((4,), Float32)
        for half in cutlass.range_constexpr(self.PAIRS_PER_LANE // 4):
            pair = first_pair + 4 * half
            cute.autovec_copy(cute.local_tile(gCS, (4,), (pair // 4,)), tCrC)
            cute.autovec_copy(cute.local_tile(gCS, (4,), ((pair + ROPE_DIM // 2) // 4,)), tCrS)
            for j in cutlass.range_constexpr(4):
                e = 2 * (4 * half + j)
                tXrF[e], tXrF[e + 1] = du.rotate_pair(tXrF[e], tXrF[e + 1], tCrC[j], tCrS[j])

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
        if const_expr(self.fmt is CacheFormat.V41_MXFP8):
            if is_rope_lane:  # V4.1 quantises the bf16-rounded rotated values too
                for i in cutlass.range_constexpr(self.DIMS_PER_LANE):
                    tXrF[i] = du.round_to_bf16(tXrF[i])
            exponent = self.quantize_group(tXrF, tXrQ)
            du.store_words(record + lane * self.DIMS_PER_LANE, tXrQ)
        else:
            exponent = self.quantize_group(tXrF, tXrQ)  # RoPE lanes' group 7 is never stored
            if is_rope_lane:
                tXrB = cute.make_rmem_tensor((self.DIMS_PER_LANE // 2,), Uint32)
                for w in cutlass.range_constexpr(self.DIMS_PER_LANE // 2):
                    tXrB[w] = du.pack_bf16x2(tXrF[2 * w], tXrF[2 * w + 1])
                rope_addr = record + NOPE_DIM + (lane - self.ROPE_FIRST_LANE) * 32
                du.store_words(rope_addr, cute.local_tile(tXrB, (4,), (0,)))
                du.store_words(rope_addr + 16, cute.local_tile(tXrB, (4,), (1,)))
            else:
                du.store_words(record + lane * self.DIMS_PER_LANE, tXrQ)
        # Scale bytes: word j of the row holds groups 4j..4j+3; group g's exponent lives in lane
        # g * group_lanes. Every lane joins the shuffles; lanes 0..words-1 store one word each, so
        # the row's scale bytes leave in one coalesced store. (V4: lane 28 owns "group 7", the
        # RoPE lanes, whose byte is the zero pad.)
        scale_byte = du.ue8m0_byte(exponent)
        if const_expr(self.fmt is CacheFormat.V4_PACKED):
            scale_byte = cutlass.select_(is_rope_lane, Int32(0), scale_byte)
        words = self.scale_bytes // 4
        packed = Uint32(0)
        for k in cutlass.range_constexpr(4):
            src = ((lane % words) * 4 + k) * self.group_lanes
            byte = cute.arch.shuffle_sync(scale_byte, offset=src)
            packed = packed | (Uint32(byte) << (8 * k))
        if lane < words:
            scale_row = page + block_size * self.data_bytes + row * self.scale_bytes
            ptr = cute.make_ptr(
                Uint32, scale_row + lane * 4, cute.AddressSpace.gmem, assumed_align=4
            )
            ptr.store(packed)

    @cute.jit
    def store_bf16(self, tXrF: cute.Tensor, row_addr: Int64) -> None:
        """NoPE dims: the input bits unchanged (bf16 -> fp32 -> bf16 is exact, so the fp32 copy
        is re-packed rather than keeping the raw registers alive); RoPE dims: RNE of the fp32
        rotation."""
        tXrB = cute.make_rmem_tensor((self.DIMS_PER_LANE // 2,), Uint32)
        for w in cutlass.range_constexpr(self.DIMS_PER_LANE // 2):
            tXrB[w] = du.pack_bf16x2(tXrF[2 * w], tXrF[2 * w + 1])
        du.store_words(row_addr, cute.local_tile(tXrB, (4,), (0,)))
        du.store_words(row_addr + 16, cute.local_tile(tXrB, (4,), (1,)))

    @cute.jit
    def store_fp8(self, tXrF: cute.Tensor, mScale: cute.Tensor, row_addr: Int64) -> None:
        """e4m3(clamp(x * fl32(1 / scale))), from fp32 (the RoPE dims are not rounded first)."""
        inv_scale = du.div_rn(Float32(1.0), mScale[0])
        tXrQ = cute.make_rmem_tensor((self.DIMS_PER_LANE // 4,), Uint32)
        for w in cutlass.range_constexpr(self.DIMS_PER_LANE // 4):
            tXrQ[w] = du.pack_e4m3x4(
                du.mul_rn(tXrF[4 * w], inv_scale),
                du.mul_rn(tXrF[4 * w + 1], inv_scale),
                du.mul_rn(tXrF[4 * w + 2], inv_scale),
                du.mul_rn(tXrF[4 * w + 3], inv_scale),
            )
        du.store_words(row_addr, tXrQ)


def _build(key: KvRopeInsertKey):
    """Tensor-free compile: symbolic token, slot and page counts; 64-bit symbolic strides."""
    fmt = key.cache_format
    tokens = du.sym()
    kv = du.fake_row_major(BFloat16, (tokens, HEAD_DIM), align=ALIGN["kv"])
    slots = du.fake_row_major(Int64, (du.sym(),), align=ALIGN["slot_mapping"])
    positions = du.fake_row_major(Int64, (tokens,), align=ALIGN["positions"])
    cos_sin = du.fake_row_major(Float32, (du.sym(), ROPE_DIM), align=ALIGN["cos_sin_cache"])
    # The kernel sees every cache as bytes (bf16/fp8 caches are viewed as uint8 by the launch).
    row_stride = du.sym_stride() if fmt.packed else du.sym_stride(VECTOR_BYTES)
    cache = du.fake_tensor(
        Uint8,
        (du.sym(), du.sym(), fmt.row_bytes),
        (du.sym_stride(VECTOR_BYTES), row_stride, 1),
        align=ALIGN["k_cache"],
    )
    scale = None
    if fmt is CacheFormat.FP8:
        scale = du.fake_row_major(Float32, (1,), align=ALIGN["fp8_scale"])
    return du.compile_tvm_ffi(
        KvRopeInsert(fmt), kv, slots, positions, cos_sin, cache, scale, du.env_stream(),
        arch=key.arch,
    )


def _variants(arch: str) -> list[KvRopeInsertKey]:
    return [KvRopeInsertKey(fmt, arch) for fmt in CacheFormat]


KERNELS = KernelCache("kv_rope_insert", _build, _variants)


def _skip(args: tuple) -> None:
    return None


def _launch(key: KvRopeInsertKey, args: tuple) -> Callable[[tuple], None]:
    """The launch of every call of the layout of ``args`` (see ``ops.cute_op``): the compiled
    function is looked up once; a byte view of a bf16/fp8 cache, and a 1-D view of a scale of
    another shape, are made per call."""
    _, k_cache, slot_mapping, _, _, _, fp8_scale, _ = args
    if slot_mapping.shape[0] == 0:
        return _skip
    fn = KERNELS.get(key)
    if key.cache_format is CacheFormat.FP8:
        flat = fp8_scale.shape != (1,)

        def launch_fp8(args: tuple) -> None:
            kv, k_cache, slot_mapping, positions, cos_sin_cache, _, fp8_scale, _ = args
            fn(kv, slot_mapping, positions, cos_sin_cache, k_cache.view(torch.uint8),
               fp8_scale.reshape(1) if flat else fp8_scale)

        return launch_fp8
    if k_cache.dtype != torch.uint8:

        def launch_view(args: tuple) -> None:
            kv, k_cache, slot_mapping, positions, cos_sin_cache, _, _, _ = args
            fn(kv, slot_mapping, positions, cos_sin_cache, k_cache.view(torch.uint8), None)

        return launch_view

    def launch(args: tuple) -> None:
        kv, k_cache, slot_mapping, positions, cos_sin_cache, _, _, _ = args
        fn(kv, slot_mapping, positions, cos_sin_cache, k_cache, None)

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
    ``N = slot_mapping.shape[0]``; negative slots are skipped; nothing else is written. Launches
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

    expect_index(slot_mapping, "slot_mapping", torch.int64, device, "kv")
    if slot_mapping.shape[0] > kv.shape[0]:
        fail("slot_mapping", f"at most {kv.shape[0]} entries (kv rows)", slot_mapping.shape[0])
    expect_index(positions, "positions", torch.int64, device, "kv", kv.shape[0],
                 "one per kv row")

    expect_arg(cos_sin_cache, "cos_sin_cache", (torch.float32,), 2, ALIGN["cos_sin_cache"],
               device, "kv", sizes={1: ROPE_DIM}, contiguous=True)

    if fmt is CacheFormat.FP8:
        expect_fp8_scale(fp8_scale, device, "kv", ALIGN["fp8_scale"])

    arch = arch_for(device)
    return KvRopeInsertKey(fmt, arch) if arch is not None else None


check_kv_rope_insert = kv_rope_insert.check

__all__ = ["KvRopeInsertKey", "KvRopeInsert", "check_kv_rope_insert", "kv_rope_insert"]
