"""CuTe DSL helpers shared by the kernels: fake tensors for tensor-free compiles, and the
arithmetic whose rounding the specs pin down.

Rounding is written as explicit PTX (``mul.rn``, ``fma.rn``, ``div.rn``, ``cvt.rn``): a plain
``a * b + c`` may be contracted into an FMA by NVVM or ptxas, and the references in
:mod:`cute_kernels.reference` must agree with the kernels bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .arch import ARCH_ENV

# The DSL latches its default target at import and silently falls back to sm_100a without a
# GPU; every compile below passes --gpu-arch explicitly, this only keeps the default honest.
if ARCH_ENV in os.environ:
    os.environ.setdefault("CUTE_DSL_ARCH", os.environ[ARCH_ENV])

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402

#: The DSL type of each torch dtype a kernel argument can have.
DSL_DTYPES = {torch.bfloat16: BFloat16, torch.float32: Float32, torch.int32: Int32,
              torch.int64: Int64, torch.uint8: Uint8, torch.float8_e4m3fn: cutlass.Float8E4M3FN}

# -- compiling ---------------------------------------------------------------------------------


def sym() -> Any:
    """A runtime extent (token counts, page counts): one compile serves every value."""
    return cute.sym_int()


def sym_stride(divisibility: int = 1) -> Any:
    """A runtime 64-bit stride, in elements, known to be a multiple of ``divisibility``."""
    return cute.sym_int64(divisibility=divisibility)


def fake_tensor(dtype: Any, shape: tuple, stride: tuple, align: int) -> Any:
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)


def fake_row_major(dtype: Any, shape: tuple, align: int) -> Any:
    order = tuple(reversed(range(len(shape))))
    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=order, assumed_align=align
    )


def fake_paged_cache(dtype: torch.dtype, width: int, page_stride_bytes: int,
                     row_stride_bytes: int, align: int) -> Any:
    """A paged cache ``[pages, block, width]`` of ``dtype`` as the caller holds it (not a byte
    view made per call: ``Tensor.view(dtype)`` costs ~1 us of host time), its page and row
    strides multiples of the given bytes; :func:`byte_view` is how a kernel addresses it."""
    elem = dtype.itemsize
    return fake_tensor(
        DSL_DTYPES[dtype], (sym(), sym(), width),
        (sym_stride(max(1, page_stride_bytes // elem)),
         sym_stride(max(1, row_stride_bytes // elem)), 1),
        align=align,
    )


@cute.jit
def byte_view(mCache: cute.Tensor) -> cute.Tensor:
    """A rank-3 tensor with unit inner stride seen as bytes: the same address, strides and
    inner extent scaled by the element size."""
    elem = mCache.element_type.width // 8
    layout = cute.make_layout(
        (mCache.shape[0], mCache.shape[1], mCache.shape[2] * elem),
        stride=(mCache.stride[0] * elem, mCache.stride[1] * elem, 1),
    )
    return cute.make_tensor(cute.recast_ptr(mCache.iterator, dtype=Uint8), layout)


def cp_async_atom(dtype: Any) -> cute.CopyAtom:
    """16-byte ``cp.async.cg`` global -> shared copies: the operand streams bypass L1 (each
    byte is read once per CTA)."""
    return cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
        dtype,
        num_bits_per_copy=128,
    )


def env_stream() -> Any:
    """The TVM-FFI environment stream: each call launches on torch's current stream, so calls
    are captured by CUDA graphs and follow ``torch.cuda.stream(...)``."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def smem_struct(name: str, **fields: Any) -> Any:
    """A ``cute.struct`` of ``fields`` (name -> member type, in order) built outside a
    ``@cute.jit`` body, where a class body's annotations would stay unevaluated strings."""
    return cute.struct(type(name, (), {"__annotations__": fields}))


def compile_tvm_ffi(launcher: Any, *fake_args: Any, arch: str) -> Any:
    return cute.compile(launcher, *fake_args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


# -- arithmetic with pinned rounding ------------------------------------------------------------


def add_rn(a: Float32, b: Float32) -> Float32:
    """fp32 sum rounded on its own (never fused with a preceding product)."""
    return cute.arch.inline_ptx(
        "add.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def sub_rn(a: Float32, b: Float32) -> Float32:
    """fp32 difference rounded on its own."""
    return cute.arch.inline_ptx(
        "sub.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def mul_rn(a: Float32, b: Float32) -> Float32:
    """fp32 product rounded on its own (never fused into a following add)."""
    return cute.arch.inline_ptx(
        "mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def fma_rn(a: Float32, b: Float32, c: Float32) -> Float32:
    """fp32 ``a * b + c`` with one rounding."""
    return cute.arch.inline_ptx(
        "fma.rn.f32 {$w0}, {$r0}, {$r1}, {$r2};",
        write_only_types=[Float32],
        read_only_args=[a, b, c],
    )


def div_rn(a: Float32, b: Float32) -> Float32:
    """IEEE fp32 division (not the approximate ``div.full``)."""
    return cute.arch.inline_ptx(
        "div.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def rotate_pair(x_even: Float32, x_odd: Float32, cos: Float32, sin: Float32) -> tuple:
    """One RoPE rotation: ``(fma(e, c, -rn(o*s)), fma(e, s, rn(o*c)))``, the rounding that
    nvcc -O3 produces for ``e*c - o*s`` / ``e*s + o*c`` (the odd product rounded, the even
    product fused)."""
    rot_even = fma_rn(x_even, cos, -mul_rn(x_odd, sin))
    rot_odd = fma_rn(x_even, sin, mul_rn(x_odd, cos))
    return rot_even, rot_odd


def _pure_f32_asm(asm: str, *args: Float32) -> Float32:
    """A side-effect-free one-result fp32 instruction (the scheduler may move and merge it)."""
    value = llvm.inline_asm(
        Float32.mlir_type,
        [Float32(a).ir_value() for a in args],
        asm,
        "=f" + ",f" * len(args),
        has_side_effects=False,
    )
    return Float32(value)


def exp2_approx(x: Float32) -> Float32:
    """``ex2.approx.ftz.f32`` (2 ulp): the exponential of the compressor's softmax."""
    return _pure_f32_asm("ex2.approx.ftz.f32 $0, $1;", x)


def rsqrt_approx_ftz(x: Float32) -> Float32:
    """``rsqrt.approx.ftz.f32``: the compressor's RMSNorm reciprocal root (as vLLM's)."""
    return _pure_f32_asm("rsqrt.approx.ftz.f32 $0, $1;", x)


def rsqrt_approx(x: Float32) -> Float32:
    """``rsqrt.approx.f32`` (no FTZ): what CUDA's ``rsqrtf`` (``torch.rsqrt`` on a GPU) and
    flashinfer's RMSNorm use."""
    return _pure_f32_asm("rsqrt.approx.f32 $0, $1;", x)


def round_to_bf16(x: Float32) -> Float32:
    """fp32 -> bf16 (round to nearest even) -> fp32."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 h; cvt.rn.bf16.f32 h, {$r0}; cvt.f32.bf16 {$w0}, h; }",
        write_only_types=[Float32],
        read_only_args=[x],
    )


def pack_bf16x2(lo: Float32, hi: Float32) -> Uint32:
    """Two fp32 -> two bf16 (RNE) in one 32-bit word, ``lo`` in the low half (lower address)."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};",
        write_only_types=[Uint32],
        read_only_args=[lo, hi],
    )


def pack_e4m3x4(v0: Float32, v1: Float32, v2: Float32, v3: Float32) -> Uint32:
    """Four fp32 -> four e4m3fn codes (RNE, saturating to +-448) in one word, ``v0`` lowest.

    For finite inputs ``satfinite`` is exactly ``clamp(v, -448, 448)`` before the rounding.
    """
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi;"
        " cvt.rn.satfinite.e4m3x2.f32 lo, {$r1}, {$r0};"
        " cvt.rn.satfinite.e4m3x2.f32 hi, {$r3}, {$r2};"
        " mov.b32 {$w0}, {lo, hi}; }",
        write_only_types=[Uint32],
        read_only_args=[v0, v1, v2, v3],
    )


def ue8m0_exponent(amax: Float32) -> Int32:
    """``e = ceil(log2(max(amax, 1e-4) / 448))`` exactly as the fp32 quotient gives it (its
    exponent, plus one unless it is an exact power of two), without the division: 448 is
    1.75 x 2^8 and scaling by 2^-8 is exact, so for ``a = m x 2^E`` (``m`` in [1, 2))
    ``fl(a / 448)`` exceeds ``2^(E - 8)`` exactly when ``m > 1.75`` (the quotient of the
    next fp32 above 1.75 x 2^E already rounds away from the power of two), and ``e`` is
    ``E - 8`` plus one then. An infinite ``amax`` gives 128, as the quotient does; NaN is
    dropped by ``max``. Checked against the quotient on every bf16 value and 5e7 fp32 values."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 a; .reg .b32 b, m; .reg .pred up, inf;"
        " max.f32 a, {$r0}, 0f38D1B717;"  # 1e-4f
        " mov.b32 b, a;"
        " and.b32 m, b, 8388607;"
        " setp.gt.u32 up, m, 6291456;"  # mantissa of 1.75
        " shr.u32 b, b, 23;"  # the sign is 0
        " setp.eq.u32 inf, b, 255;"
        " add.s32 b, b, -135;"  # - 127 (bias) - 8 (448 = 1.75 x 2^8)
        " @up add.s32 b, b, 1;"
        " @inf mov.b32 b, 128;"
        " mov.b32 {$w0}, b; }",
        write_only_types=[Int32],
        read_only_args=[amax],
    )


def exp2_neg(e: Int32) -> Float32:
    """``2^-e`` as an exact fp32 (e in [-126, 127]; a larger e, from infinite input, gives 0)."""
    biased = cutlass.max(Int32(127) - e, Int32(0))
    return cute.arch.inline_ptx(
        "{ .reg .b32 b; shl.b32 b, {$r0}, 23; mov.b32 {$w0}, b; }",
        write_only_types=[Float32],
        read_only_args=[biased],
    )


def ue8m0_byte(e: Int32) -> Int32:
    """The UE8M0 scale byte ``clamp(e + 127, 0, 255)``."""
    return cutlass.min(cutlass.max(e + Int32(127), Int32(0)), Int32(255))


def abs_max(values: Any, count: int, start: Float32) -> Float32:
    """Max of ``|values[i]|`` over ``count`` register elements, starting from ``start``: a
    pairwise tree (depth log2 of ``count``, not ``count``: the max is on a slot's latency
    chain), the same value as any order (``max`` drops a NaN operand, and is exact)."""
    level = [abs(values[i]) for i in range(count)]  # plain helper: unrolled at trace time
    while len(level) > 1:
        pairs = [cute.arch.fmax(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
    return cute.arch.fmax(start, level[0])


def store_words(addr: Int64, words: Any, align: int = 16) -> None:
    """Store a register fragment of 32-bit words at a byte address with one vector store."""
    ptr = cute.make_ptr(Uint32, addr, cute.AddressSpace.gmem, assumed_align=align)
    cute.autovec_copy(words, cute.make_tensor(ptr, cute.make_layout(cute.size(words))))


def unpack_bf16x2(word: Uint32) -> tuple[Float32, Float32]:
    """One 32-bit word of two bf16 -> (low half, high half) as fp32 (exact)."""
    return cute.arch.inline_ptx(
        "shl.b32 {$w0}, {$r0}, 16; and.b32 {$w1}, {$r0}, 0xFFFF0000;",
        write_only_types=[Float32, Float32],
        read_only_args=[word],
    )


# -- division by a runtime divisor ---------------------------------------------------------------


def divisor_magic(d: Int32) -> tuple:
    """``(m, l)`` that divide by ``d`` (``1 <= d < 2^31``) with :func:`divide_by_magic`:
    ``l = ceil(log2 d)``, ``m = floor(2^32 (2^l - d) / d) + 1`` (Granlund and Montgomery's
    round-up method). Computed in the kernel, once per thread: the DSL's own fast-divmod
    divisor is hoisted to the host launcher, which then pays for it on every call. A power of
    two (``2^l - d = 0``: ``m = 1``) skips the 64-bit division, a subroutine of ~70
    instructions."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 dm1, z; .reg .b64 num, dd, q; .reg .pred pow2;"
        " sub.u32 dm1, {$r0}, 1; clz.b32 z, dm1; sub.u32 {$w1}, 32, z;"
        " cvt.u64.u32 dd, {$r0}; shl.b64 num, 1, {$w1}; sub.u64 num, num, dd;"
        " setp.eq.u64 pow2, num, 0; shl.b64 num, num, 32; mov.u64 q, 0;"
        " @!pow2 div.u64 q, num, dd; add.u64 q, q, 1; cvt.u32.u64 {$w0}, q; }",
        write_only_types=[Uint32, Uint32],
        read_only_args=[d],
    )


def divide_by_magic(n: Int32, magic: tuple) -> Int32:
    """``n // d`` for ``0 <= n < 2^31`` and the ``(m, l)`` of :func:`divisor_magic` (``d``):
    ``(umulhi(m, n) + n) >> l``, three instructions (the sum cannot overflow: ``n < 2^31``)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t; mul.hi.u32 t, {$r1}, {$r0}; add.u32 t, t, {$r0};"
        " shr.u32 {$w0}, t, {$r2}; }",
        write_only_types=[Int32],
        read_only_args=[n, magic[0], magic[1]],
    )


# -- asynchronous global -> shared copies (a per-thread cp.async ring) ---------------------------
# Written as PTX so that the copies, the group fences and the shared loads stay in program order
# (each is a side-effecting asm statement the compiler does not move across another).


def evict_first_policy() -> Int64:
    """An L2 cache policy for the loads of data a kernel reads once (:func:`cp_async_16`'s
    ``policy``, a TMA copy's ``cache_policy``): the lines they allocate are the first the L2
    evicts, so the stream replaces its own, clean lines rather than lines other kernels left
    there — dirty ones in particular, whose write-back shares the DRAM with the stream. One
    instruction; compute it once per thread. Whether it pays is measured per kernel (PERF.md):
    a policy of the usual priority (``L2::evict_normal``) is not the same as no hint — it
    measured up to 12 % slower on the H200 — so loads that should not evict first carry none."""
    return cute.arch.inline_ptx("createpolicy.fractional.L2::evict_first.b64 {$w0}, 1.0;",
                                write_only_types=[Int64])


def cp_async_16(smem_addr: Int32, gmem_addr: Int64, policy: Int64 | None = None) -> None:
    """16 bytes global -> shared, L2 only (``.cg``: each byte is read once), with the L2
    cache ``policy`` when given (:func:`evict_first_policy`)."""
    if policy is None:
        cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                             read_only_args=[smem_addr, gmem_addr])
    else:
        cute.arch.inline_ptx(
            "cp.async.cg.shared.global.L2::cache_hint [{$r0}], [{$r1}], 16, {$r2};",
            read_only_args=[smem_addr, gmem_addr, policy])


def cp_async_commit() -> None:
    """Close this thread's current group of copies (an empty group is legal)."""
    cute.arch.inline_ptx("cp.async.commit_group;")


def cp_async_wait(pending: int) -> None:
    """Wait until at most ``pending`` of this thread's most recent groups are in flight."""
    cute.arch.inline_ptx(f"cp.async.wait_group {pending};")


def load_global_v4(gmem_addr: Int64) -> tuple:
    """Four 32-bit words from a 16-byte aligned global address, one load cached in L2 only
    (``.cg``: each byte is read once); the registers are ready when first used."""
    return cute.arch.inline_ptx(
        "ld.global.cg.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[gmem_addr],
    )


def load_global_f32x2(gmem_addr: Int64) -> tuple:
    """Two fp32 from an 8-byte aligned global address, one load from L2 (``.cg``: data
    another SM wrote, past an acquire, is never served from this SM's L1)."""
    return cute.arch.inline_ptx(
        "ld.global.cg.v2.f32 {{$w0}, {$w1}}, [{$r0}];",
        write_only_types=[Float32] * 2,
        read_only_args=[gmem_addr],
    )


def load_shared_v4(smem_addr: Int32, dtype: type = Uint32) -> tuple:
    """Four 32-bit values (``Uint32`` or ``Float32``) from a 16-byte aligned shared address,
    one load."""
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[dtype] * 4,
        read_only_args=[smem_addr],
    )


def store_shared_v4(smem_addr: Int32, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32) -> None:
    """Four 32-bit words to a 16-byte aligned shared address, one store."""
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[smem_addr, w0, w1, w2, w3])


def load_shared_b32(smem_addr: Int32, dtype: type = Uint32) -> Any:
    """One 32-bit value (``Uint32`` or ``Float32``) from a 4-byte aligned shared address."""
    return cute.arch.inline_ptx("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[dtype],
                                read_only_args=[smem_addr])


def store_shared_b32(smem_addr: Int32, value: Any) -> None:
    """One 32-bit value to a 4-byte aligned shared address."""
    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[smem_addr, value])


def load_shared_f32x2(smem_addr: Int32) -> tuple:
    """Two fp32 from an 8-byte aligned shared address, one load."""
    return cute.arch.inline_ptx(
        "ld.shared.v2.f32 {{$w0}, {$w1}}, [{$r0}];",
        write_only_types=[Float32] * 2,
        read_only_args=[smem_addr],
    )


# -- an mbarrier ring filled by bulk copies (one producer thread, many consumer threads) --------


def mbarrier_init(bar_addr: Int32, count: int) -> None:
    """Initialise the mbarrier at ``bar_addr`` (8-byte aligned, this CTA's shared memory) for
    ``count`` arrivals a phase. One thread; then ``cute.arch.mbarrier_init_fence()`` and a CTA
    barrier before any other thread uses it."""
    cute.arch.inline_ptx("mbarrier.init.shared::cta.b64 [{$r0}], {$r1};",
                         read_only_args=[bar_addr, Int32(count)])


def mbarrier_arrive(bar_addr: Int32) -> None:
    """Arrive on the mbarrier at ``bar_addr`` (release: this thread's earlier memory accesses,
    shared-memory reads included, happen before the phase completes)."""
    cute.arch.inline_ptx("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [{$r0}]; }",
                         read_only_args=[bar_addr])


def mbarrier_arrive_expect_tx(bar_addr: Int32, tx_bytes: int) -> None:
    """Arrive on the mbarrier at ``bar_addr`` and make its phase wait for ``tx_bytes`` more
    bytes of asynchronous copies (:func:`cp_async_bulk_g2s`) as well."""
    cute.arch.inline_ptx(
        "{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [{$r0}], {$r1}; }",
        read_only_args=[bar_addr, Int32(tx_bytes)])


def mbarrier_wait(bar_addr: Int32, phase: Int32) -> None:
    """Wait until the mbarrier at ``bar_addr`` has completed the phase of parity ``phase``
    (acquire: what its arrivals released, and the bytes its copies wrote, are visible). A
    fresh barrier counts as having completed the phase of parity 1."""
    cute.arch.inline_ptx(
        "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [{$r0}], {$r1};"
        " @!done bra WAIT; }",
        read_only_args=[bar_addr, phase])


def cp_async_bulk_g2s(smem_addr: Int32, gmem_addr: Int64, size: int, bar_addr: Int32,
                      policy: Int64 | None = None) -> None:
    """``size`` contiguous bytes (a multiple of 16; both addresses 16-byte aligned) global ->
    shared by the TMA unit, one instruction; their arrival counts against the transaction
    bytes of the mbarrier at ``bar_addr``. With the L2 cache ``policy`` when given
    (:func:`evict_first_policy`)."""
    if policy is None:
        cute.arch.inline_ptx(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [{$r0}], [{$r1}], {$r2}, [{$r3}];",
            read_only_args=[smem_addr, gmem_addr, Int32(size), bar_addr])
    else:
        cute.arch.inline_ptx(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [{$r0}], [{$r1}], {$r2}, [{$r3}], {$r4};",
            read_only_args=[smem_addr, gmem_addr, Int32(size), bar_addr, policy])


def store_peer_f32(smem_addr: Int32, peer_rank: Int32, value: Float32) -> None:
    """Write an fp32 to the same shared-memory offset of CTA ``peer_rank`` of this cluster
    (distributed shared memory). A release cluster barrier after it orders it before the
    peer's acquire wait."""
    llvm.inline_asm(
        None,
        [Int32(smem_addr).ir_value(), Int32(peer_rank).ir_value(), Float32(value).ir_value()],
        "{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $0, $1;"
        " st.shared::cluster.f32 [remote], $2; }",
        "r,r,f",
        has_side_effects=True,
    )


def mbarrier_try_wait_cluster(bar_addr: Int32, phase: Int32) -> Int32:
    """1 once the mbarrier at ``bar_addr`` (this CTA's shared memory) has completed phase
    ``phase``, else 0 after a bounded wait; acquire at cluster scope, so the peer CTA's
    writes released by its arrivals are visible."""
    return cute.arch.inline_ptx(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, "
        "[{$r0}], {$r1}; selp.b32 {$w0}, 1, 0, p; }",
        write_only_types=[Int32], read_only_args=[bar_addr, phase])


def load_peer_v4(smem_addr: Int32, peer_rank: Int32, wanted: Int32) -> tuple:
    """Four fp32 from the same 16-byte aligned shared-memory offset of CTA ``peer_rank`` of
    this cluster, one distributed-shared-memory load when ``wanted`` is nonzero, else four
    zeros and no load (a predicated load: a hand-over that issues its loads for the most
    ranks a cluster can have moves no bytes for the ranks this one lacks). Needs a cluster
    barrier between the peer's writes and this read, and another before the peer exits."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 remote; .reg .pred wanted; setp.ne.b32 wanted, {$r2}, 0;"
        " mov.b32 {$w0}, 0; mov.b32 {$w1}, 0; mov.b32 {$w2}, 0; mov.b32 {$w3}, 0;"
        " mapa.shared::cluster.u32 remote, {$r0}, {$r1};"
        " @wanted ld.shared::cluster.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [remote]; }",
        write_only_types=[Float32] * 4,
        read_only_args=[smem_addr, peer_rank, wanted],
    )


# -- cross-CTA hand-over through global memory (stream-K partials) -------------------------------


def store_f32x2(addr: Int64, lo: Float32, hi: Float32) -> None:
    """Two fp32 at an 8-byte aligned byte address, one store."""
    cute.arch.inline_ptx(
        "st.global.v2.f32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[addr, lo, hi]
    )


def store_f32x4(addr: Int64, v0: Float32, v1: Float32, v2: Float32, v3: Float32) -> None:
    """Four fp32 at a 16-byte aligned byte address, one store."""
    cute.arch.inline_ptx(
        "st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[addr, v0, v1, v2, v3],
    )


def fence_acq_rel() -> None:
    """``fence.acq_rel.gpu``: after a relaxed atomic that observed other CTAs' releases, their
    stores are visible to this thread's later loads (and, through a CTA barrier, its CTA's)."""
    cute.arch.inline_ptx("fence.acq_rel.gpu;")


def atomic_add_release(addr: Int64, value: Int32) -> Int32:
    """``atomicAdd`` at gpu scope after a release fence; returns the old value. Every store
    this thread made (and, through a preceding CTA barrier, its CTA made) is visible to any
    thread that observes the new value with :func:`load_acquire`."""
    return cute.arch.inline_ptx(
        "fence.acq_rel.gpu; atom.relaxed.gpu.global.add.s32 {$w0}, [{$r0}], {$r1};",
        write_only_types=[Int32],
        read_only_args=[addr, value],
    )


def load_acquire(addr: Int64) -> Int32:
    """An int32 at gpu scope with acquire semantics (later loads see what the releaser saw)."""
    return cute.arch.inline_ptx(
        "ld.acquire.gpu.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[addr]
    )


def store_relaxed(addr: Int64, value: Int32) -> None:
    """An int32 store at gpu scope (no ordering)."""
    cute.arch.inline_ptx("st.relaxed.gpu.global.b32 [{$r0}], {$r1};", read_only_args=[addr, value])
