"""``compress_c128``'s host side: the compile key and the choice of core, the validation, the
build of each variant, the launch and the public op."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from cutlass import Float32, Int32, Int64

from .. import dsl_utils as du
from ..arch import (
    arch_for,
    device_index,
    max_active_clusters,
    queried_max_active_clusters,
    sm_count,
)
from ..compile_cache import KernelCache
from ..layouts import (
    C128_FORMATS,
    C128_STATE_BLOCK,
    C128_STATE_WIDTH,
    CACHE_DTYPES,
    HEAD_DIM,
    NORM_DTYPES,
    ROPE_DIM,
    CacheFormat,
    cache_format,
    norm_dtype_name,
)
from ..ops import cute_op, skip_launch
from ..validation import (
    expect_arg,
    expect_eps,
    expect_fp8_scale,
    expect_index,
    expect_paged_cache_strides,
    expect_positive_int,
    expect_stride_multiple,
    fail,
)
from .cluster import CompressC128
from .stream import CompressC128Stream

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
    if state_cache.shape[0] == 0:  # page ids are clamped into the cache: it needs a page
        fail("state_cache", "at least one page", f"shape {tuple(state_cache.shape)}")
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

    expect_fp8_scale(fp8_scale, device, "state_cache", ALIGN["fp8_scale"],
                     fmt is CacheFormat.FP8)

    arch = arch_for(device)
    if arch is None:
        return None
    return CompressC128Key(fmt, norm_dtype_name(norm_weight.dtype), arch, core_for(num_tokens))


check_compress_c128 = compress_c128.check

__all__ = ["CORES", "CORE_ENV", "STREAM_MIN_TOKENS", "CompressC128Key", "check_compress_c128",
           "compress_c128", "core_for"]
