"""Host side of the stacked KV projection: validation, the compile key, the tensor-free build,
the launch and the public op. Contract: specs/stacked_kv_proj.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import tvm_ffi
from cutlass import BFloat16, Float32, Int32, Int64

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
    NORM_DTYPES,
    STACKED_HEAD_DIMS,
    STACKED_K_TILE,
    STACKED_MAX_LAYERS,
    VECTOR_BYTES,
    norm_dtype_name,
)
from ..ops import cute_op, skip_launch
from ..validation import (
    LayoutError,
    describe,
    expect_arg,
    expect_base_aligned,
    expect_dtype,
    expect_eps,
    expect_index,
    expect_rank,
    expect_same_device,
    expect_tensor,
    fail,
)
from .mma import StackedKvProjMma
from .plan import (
    OVERRIDE_ENVS,
    SWAPPED_WGMMA_MAX_COLUMNS,
    TILES,
    StackedLayout,
    StackedPlan,
    StackedVariant,
    check_overrides,
    check_tile_layout,
    choose_plan,
    impls_for,
    tile_n,
    tiles_for,
    variants_for,
)
from .wgmma import StackedKvProjWgmma
from .wgmma_swap import StackedKvProjWgmmaSwap
from .wgmma_swap_persistent import StackedKvProjWgmmaSwapPersistent

#: Byte alignment of each tensor argument: what the kernel is compiled to assume (the fake
#: tensors of :func:`_build`) and what the validation checks, from this one table. Rows of
#: ``ctx_hidden``, ``weight`` and the caches are also 16-byte strided (TMA and 16-byte
#: vectors).
ALIGN = {"ctx_hidden": VECTOR_BYTES, "weight": VECTOR_BYTES, "bias": VECTOR_BYTES,
         "k_norm_weight": VECTOR_BYTES, "positions": 8, "cos_sin_cache": VECTOR_BYTES,
         "cache_loc": 8, "k_caches": VECTOR_BYTES, "v_caches": VECTOR_BYTES,
         "cache_loc_2d": 8, "commit_lens": 4}
ROW_STRIDE_ELEMS = VECTOR_BYTES // 2  # bf16 row strides are multiples of 8 elements


@dataclasses.dataclass(frozen=True)
class StackedKvProjKey:
    """Everything that changes the generated code: the layout and the variant (core, tile).
    T, H, the slot counts, the cos/sin table length, the cache row strides, W, eps and the
    wgmma core's schedule (grid, data-parallel / stream-K split) are runtime values."""

    layout: StackedLayout
    variant: StackedVariant

    @property
    def arch(self) -> str:
        return self.layout.arch


def _build(key: StackedKvProjKey):
    """Tensor-free compile: T, H, slots, max_pos, bs and the cache row strides are symbolic."""
    layout, variant = key.layout, key.variant
    if variant.impl not in impls_for(layout.arch):
        raise LayoutError(f"impl: expected one of {impls_for(layout.arch)} for "
                          f"{layout.arch}, got {variant.impl}")
    if variant.tile not in tiles_for(variant.impl):
        raise LayoutError(f"tile: expected one of {tiles_for(variant.impl)} for the {variant.impl} "
                          f"core, got {variant.tile}")
    if variant.cluster and variant.impl != "mma" and not TILES[variant.tile].tokens_n:
        raise LayoutError(f"cluster: expected the cluster hand-over on the mma core or a "
                          f"swapped wgmma tile only, got {variant.tile} on the {variant.impl} "
                          f"core")
    d = layout.head_dim
    n_total = layout.columns
    norm_dtype = du.DSL_DTYPES[NORM_DTYPES[layout.norm_dtype]]
    tokens, hidden = du.sym(), du.sym()
    row_stride = du.sym_stride(ROW_STRIDE_ELEMS)
    x = du.fake_tensor(BFloat16, (tokens, hidden), (row_stride, 1), align=ALIGN["ctx_hidden"])
    w = du.fake_tensor(BFloat16, (n_total, hidden), (du.sym_stride(ROW_STRIDE_ELEMS), 1),
                       align=ALIGN["weight"])
    bias = None
    if layout.has_bias:
        bias = du.fake_row_major(BFloat16, (n_total,), align=ALIGN["bias"])
    norm_w = du.fake_row_major(norm_dtype, (layout.num_layers, d), align=ALIGN["k_norm_weight"])
    pos = du.fake_row_major(Int64, (tokens,), align=ALIGN["positions"])
    cos_sin = du.fake_row_major(Float32, (du.sym(), d), align=ALIGN["cos_sin_cache"])
    loc = du.fake_row_major(Int64, (tokens,), align=ALIGN["cache_loc"])
    commit = None
    if layout.has_commit:  # cache_loc_2d [bs, W] as it comes (its row stride may read as 1 at
        # bs = 1, so it is symbolic; the validation asks for a contiguous tensor)
        loc = du.fake_tensor(Int64, (du.sym(), du.sym()), (du.sym_stride(), 1),
                             align=ALIGN["cache_loc_2d"])
        commit = du.fake_row_major(Int32, (du.sym(),), align=ALIGN["commit_lens"])

    def cache(arg: str):
        return du.fake_tensor(BFloat16, (du.sym(), layout.n_kv, d),
                              (du.sym_stride(ROW_STRIDE_ELEMS), d, 1), align=ALIGN[arg])

    k_caches = tuple(cache("k_caches") for _ in range(layout.num_layers))
    v_caches = tuple(cache("v_caches") for _ in range(layout.num_layers))
    core_args = (layout.num_layers, layout.n_kv, d, layout.has_bias, layout.has_commit,
                 norm_dtype, TILES[variant.tile])
    if variant.impl == "mma":
        kernel = StackedKvProjMma(*core_args, variant.cluster)
    elif TILES[variant.tile].tokens_n:
        if tile_n(d, layout.kv) > SWAPPED_WGMMA_MAX_COLUMNS:
            raise LayoutError(f"tile: expected a tile of whole heads for D = {d} (a swapped "
                              f"wgmma tile holds at most {SWAPPED_WGMMA_MAX_COLUMNS} weight "
                              f"rows), got {variant.tile}")
        if TILES[variant.tile].persistent:
            kernel = StackedKvProjWgmmaSwapPersistent(*core_args)
        else:
            kernel = StackedKvProjWgmmaSwap(*core_args, variant.cluster)
    else:
        kernel = StackedKvProjWgmma(*core_args)
    # the split-K / stream-K workspace and counters, then the wgmma core's grid and DP tiles,
    # or the mma core's K splits per tile
    schedule = (du.fake_row_major(Float32, (du.sym(),), align=WORKSPACE_ALIGN),
                du.fake_row_major(Int32, (du.sym(),), align=4),
                *((Int32(1), Int32(1)) if variant.impl == "wgmma" else (Int32(1),)))
    return du.compile_tvm_ffi(
        kernel, x, w, bias, norm_w, Float32(1e-6), pos, cos_sin, loc, commit, Int32(1),
        k_caches, v_caches, *schedule, du.env_stream(), arch=layout.arch,
    )


def _variants(arch: str) -> list[StackedKvProjKey]:
    """The drafter layout built up front: the Qwen3 DSpark/DFlash drafters at TP1 (5 layers,
    D = 128, 8 KV heads), fp32 stacked norm weight, no bias, with and without the commit-lens
    rows, every variant the arch has. Other layouts compile on first use (~1 s)."""
    return [
        StackedKvProjKey(StackedLayout(5, 8, 128, False, commit, "float32", arch), variant)
        for variant in variants_for(arch)
        for commit in (False, True)
    ]


KERNELS = KernelCache("stacked_kv_proj", _build, _variants)


# -- validation ---------------------------------------------------------------------------------


def _cache_ok(c: object, device: torch.device, n_kv: int, head_dim: int) -> bool:
    """The common case in one pass (a serving step checks 2L caches per call; this is the
    host-time hot spot of a call)."""
    if (not isinstance(c, torch.Tensor) or c.dtype is not torch.bfloat16
            or c.layout is not torch.strided or c.is_nested):
        return False
    shape = c.shape
    if len(shape) != 3 or shape[1] != n_kv or shape[2] != head_dim or c.device != device:
        return False
    s0, s1, s2 = c.stride()
    if s2 != 1 or (n_kv > 1 and s1 != head_dim):
        return False
    if shape[0] > 1 and (s0 < n_kv * head_dim or (s0 * 2) % VECTOR_BYTES):
        return False
    return c.data_ptr() % ALIGN["k_caches"] == 0  # 0 for meta and empty tensors


def _expect_caches(caches: object, arg: str, device: torch.device, n_kv: int | None,
                   head_dim: int | None) -> tuple[int, int]:
    if not isinstance(caches, (list, tuple)) or len(caches) == 0:
        fail(arg, "a non-empty list of tensors", describe(caches))
    if len(caches) > STACKED_MAX_LAYERS:
        fail(arg, f"at most {STACKED_MAX_LAYERS} layers", len(caches))
    for i, c in enumerate(caches):
        if n_kv is None and isinstance(c, torch.Tensor) and c.dim() == 3:
            n_kv, head_dim = c.shape[1], c.shape[2]
        if head_dim in STACKED_HEAD_DIMS and _cache_ok(c, device, n_kv, head_dim):
            continue
        name = f"{arg}[{i}]"  # something is wrong: find it and say what
        expect_tensor(c, name)
        expect_same_device(c, name, device, "ctx_hidden")
        expect_dtype(c, name, torch.bfloat16)
        expect_rank(c, name, 3)
        if head_dim not in STACKED_HEAD_DIMS:
            fail(name, f"head dim (shape[2]) in {STACKED_HEAD_DIMS}", f"shape {tuple(c.shape)}")
        if tuple(c.shape[1:]) != (n_kv, head_dim):
            fail(name, f"shape [slots, {n_kv}, {head_dim}]", f"shape {tuple(c.shape)}")
        if c.stride(2) != 1 or (n_kv > 1 and c.stride(1) != head_dim):
            fail(name, f"strides (s0, {head_dim}, 1)", f"strides {c.stride()}")
        if c.shape[0] > 1 and c.stride(0) < n_kv * head_dim:
            fail(name, f"stride(0) >= {n_kv * head_dim} (rows must not overlap)", c.stride())
        if c.shape[0] > 1 and (c.stride(0) * 2) % VECTOR_BYTES:
            fail(name, f"stride(0) a multiple of {VECTOR_BYTES} bytes",
                 f"{c.stride(0)} elements = {c.stride(0) * 2} bytes")
        expect_base_aligned(c, name, ALIGN[arg])
        raise AssertionError(f"{name}: _cache_ok and the detailed checks disagree")
    return n_kv, head_dim


def _expect_rows(t: torch.Tensor, arg: str, inner: int) -> None:
    """bf16 [rows, inner] with unit inner stride and a 16-byte row stride."""
    if t.stride(1) != 1 and t.shape[1] > 1:
        fail(arg, "stride 1 in dim 1", f"strides {t.stride()}")
    if t.shape[0] > 1 and ((t.stride(0) * 2) % VECTOR_BYTES or t.stride(0) < inner):
        fail(arg, f"stride(0) >= {inner} and a multiple of {VECTOR_BYTES} bytes",
             f"strides {t.stride()}")



def _resident_ctas(device: torch.device) -> int:
    """CTAs of the wgmma core the GPU runs at once: one per SM (the ring fills the SMEM), as
    many as the driver reports resident for the largest CTA (3 warpgroups). The stream-K
    schedule waits on other CTAs of its grid, so its grid must never exceed this."""
    return max_active_clusters(device_index(device), *_RESIDENT_QUERY)


_RESIDENT_QUERY = (1, 1, 128 * 3)  # clusters of 1 CTA, 1 per SM, 3 warpgroups


# Hand-over buffers of split tiles, per (device, stream): the wgmma core's stream-K slots (a
# CTA's first and last tile) or the mma core's split-K slots (one per CTA), and a counter per
# split tile. Allocated on first use and kept (a CUDA graph
# captures their addresses; the kernel returns the counters to zero), grown when a larger
# tile or grid needs more: the old buffers stay alive for graphs that captured them. Calls on
# different streams get different buffers, so they may run concurrently.
WORKSPACE_ALIGN = 16
_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []
# torch's current stream of a device, as the cudaStream_t TVM-FFI launches on: the raw query
# costs a fraction of building a torch.cuda.Stream object
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _workspace(device: torch.device, index: int, stream: int, floats: int,
               counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers of ``stream`` on CUDA ``device`` (of index ``index``), at least ``floats``
    fp32 slots and ``counters`` int32 counters."""
    key = (index, stream)
    held = _workspaces.get(key)
    if held is None or held[0].numel() < floats or held[1].numel() < counters:
        if held is not None:
            _retired.append(held)
            floats = max(floats, held[0].numel())
            counters = max(counters, held[1].numel())
        held = (torch.empty(floats, dtype=torch.float32, device=device),
                torch.zeros(counters, dtype=torch.int32, device=device))
        _workspaces[key] = held
    return held


#: threads of the mma core's swapped CTA, whose clusters the plan asks the driver about
SWAP_THREADS = 32 * StackedKvProjMma.SWAP_WARPS[0] * StackedKvProjMma.SWAP_WARPS[1]


def _plan(layout: StackedLayout, ctx_hidden: torch.Tensor) -> tuple[StackedPlan, bool]:
    """The plan of a call, and whether it is final: made with the driver's resident counts,
    which never change, rather than the formula :func:`max_active_clusters` falls back on
    while it cannot query (then the call after plans again)."""
    device = ctx_hidden.device
    index = device_index(device)
    resident = _resident_ctas(device) if layout.arch == "sm_90a" else sm_count(device)
    final = layout.arch != "sm_90a" or queried_max_active_clusters(index, *_RESIDENT_QUERY)
    asked: list[tuple] = []

    def residency(size: int, per_sm: int) -> int:
        asked.append((index, size, per_sm, SWAP_THREADS))
        return max_active_clusters(*asked[-1]) * size

    plan = choose_plan(layout, ctx_hidden.shape[0], ctx_hidden.shape[1], resident, residency)
    return plan, final and all(queried_max_active_clusters(*query) for query in asked)


def plan_for_call(args: tuple) -> StackedPlan:
    """The plan a call of :func:`stacked_kv_proj` with these (positional, CUDA) arguments
    runs: what ``make perf`` reports next to each time."""
    return _plan(stacked_kv_proj.validate(*args), args[0])[0]


def _launch(layout: StackedLayout, args: tuple) -> Callable[[tuple], None]:
    """The launch of every call of the layout of ``args`` (see ``ops.cute_op``): the plan (T,
    H and the ``CUTE_KERNELS_STACKED_*`` overrides are part of the layout), the compiled
    function and the workspace size are found once; the stream's workspace once per stream;
    the cache tuples per call."""
    ctx_hidden = args[0]
    if ctx_hidden.shape[0] == 0:
        return skip_launch
    plan, final = _plan(layout, ctx_hidden)
    if not final:  # plan each call until the driver's queries work
        return lambda args: _planned(layout, _plan(layout, args[0])[0], args)(args)
    return _planned(layout, plan, args)


def _planned(layout: StackedLayout, plan: StackedPlan, args: tuple) -> Callable[[tuple], None]:
    """The launch of the layout of ``args`` (T > 0) with ``plan``."""
    ctx_hidden, _, _, _, _, _, _, _, _, _, cache_loc_2d, _ = args
    device = ctx_hidden.device
    fn = KERNELS.get(StackedKvProjKey(layout, plan.variant))
    width = 1 if cache_loc_2d is None else cache_loc_2d.shape[1]
    # (device index, fp32 slots, counters) of the hand-over buffers, and the schedule
    tile = TILES[plan.variant.tile]
    slot_floats = tile.bm * tile.columns(layout.head_dim, layout.kv)
    index = device_index(device)
    if tile.tokens_n:  # a swapped wgmma plan: one CTA per tile or split, its grid and split
        handover = False
        workspace = (4, 1)
        grid_args: tuple = (plan.grid, plan.splits)
    elif plan.variant.impl == "wgmma":  # two stream-K slots per CTA, a counter per tile
        handover = True
        workspace = (2 * plan.grid * slot_floats, 2 * plan.grid)
        grid_args = (plan.grid, plan.dp_tiles)
    else:  # a slot per CTA of a tile split over the workspace, a counter per tile
        handover = plan.splits > 1 and not plan.variant.cluster
        workspace = (plan.grid * slot_floats, plan.dp_tiles) if handover else (4, 1)
        grid_args = (plan.splits,)
    # The schedule of the stream this layout last launched on: that stream's hand-over
    # buffers, converted to TVM-FFI tensors once (they are ours, their metadata never
    # changes; a converted tensor keeps its buffer alive, so a schedule stays valid after
    # another layout outgrows the stream's buffers), then the grid arguments. A plan that
    # hands nothing over through memory (one CTA per tile, or a cluster's DSMEM) never
    # touches them: it gets the buffers of stream 0 once, and asks for no stream.
    last: list = [None, ()]
    if not handover:
        buffers = _workspace(device, index, 0, *workspace)
        last[:] = 0, (*map(tvm_ffi.from_dlpack, buffers), *grid_args)

    def launch(args: tuple) -> None:
        (ctx_hidden, weight, bias, k_norm_weight, eps, positions, cos_sin_cache, cache_loc,
         k_caches, v_caches, cache_loc_2d, commit_lens) = args
        if handover:  # the hand-over buffers belong to the current stream
            stream = _current_stream(index)
            if stream != last[0]:
                buffers = _workspace(device, index, stream, *workspace)
                last[:] = stream, (*map(tvm_ffi.from_dlpack, buffers), *grid_args)
        fn(ctx_hidden, weight, bias, k_norm_weight, float(eps), positions, cos_sin_cache,
           cache_loc if cache_loc_2d is None else cache_loc_2d, commit_lens, width,
           tuple(k_caches), tuple(v_caches), *last[1])

    return launch


@cute_op("stacked_kv_proj", mutates_args=("k_caches", "v_caches"), prepare=_launch,
         env=OVERRIDE_ENVS)
def stacked_kv_proj(
    ctx_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None = None,
    commit_lens: torch.Tensor | None = None,
) -> StackedLayout | None:
    """All layers' K/V projection + K RMSNorm + NeoX RoPE, written into the KV caches.

    One launch, no intermediate in global memory; launches on the current stream with no host
    sync or allocation (CUDA-graph safe). ``cache_loc_2d`` (with ``commit_lens``) replaces
    ``cache_loc`` when given; negative slots, slots past a cache (for that cache) and positions
    outside ``cos_sin_cache`` are skipped. See specs/stacked_kv_proj.md.
    """
    expect_arg(ctx_hidden, "ctx_hidden", (torch.bfloat16,), 2, ALIGN["ctx_hidden"])
    device = ctx_hidden.device
    tokens, hidden = ctx_hidden.shape
    if hidden == 0 or hidden % STACKED_K_TILE:
        fail("ctx_hidden",
             f"a hidden size (shape[1]) that is a positive multiple of {STACKED_K_TILE}",
             f"shape {tuple(ctx_hidden.shape)}")
    _expect_rows(ctx_hidden, "ctx_hidden", hidden)

    num_layers = len(k_caches) if isinstance(k_caches, (list, tuple)) else 0
    n_kv, head_dim = _expect_caches(k_caches, "k_caches", device, None, None)
    _expect_caches(v_caches, "v_caches", device, n_kv, head_dim)
    if len(v_caches) != num_layers:
        fail("v_caches", f"{num_layers} tensors (one per layer, like k_caches)", len(v_caches))
    kv = n_kv * head_dim

    # unquantised weights only
    expect_arg(weight, "weight", (torch.bfloat16,), 2, ALIGN["weight"], device, "ctx_hidden")
    if tuple(weight.shape) != (num_layers * 2 * kv, hidden):
        fail("weight", f"shape [L*2*n_kv*D, H] = [{num_layers * 2 * kv}, {hidden}] "
             f"(L={num_layers}, n_kv={n_kv}, D={head_dim})", f"shape {tuple(weight.shape)}")
    _expect_rows(weight, "weight", hidden)
    bn = tile_n(head_dim, kv)
    if kv % bn or bn % head_dim:
        fail("weight", f"kv = n_kv*D a multiple of the {bn}-column tile", f"kv = {kv}")

    if bias is not None:
        expect_arg(bias, "bias", (torch.bfloat16,), 1, ALIGN["bias"], device, "ctx_hidden",
                   contiguous=True)
        if bias.shape[0] != weight.shape[0]:
            fail("bias", f"{weight.shape[0]} entries (one per weight row)", tuple(bias.shape))

    expect_arg(k_norm_weight, "k_norm_weight", tuple(NORM_DTYPES.values()), 2,
               ALIGN["k_norm_weight"], device, "ctx_hidden")
    if tuple(k_norm_weight.shape) != (num_layers, head_dim):
        fail("k_norm_weight", f"shape [L, D] = [{num_layers}, {head_dim}]",
             f"shape {tuple(k_norm_weight.shape)}")
    if not k_norm_weight.is_contiguous():
        fail("k_norm_weight", "a contiguous tensor", f"strides {k_norm_weight.stride()}")

    expect_eps(eps)

    for name, t in (("positions", positions), ("cache_loc", cache_loc)):
        expect_index(t, name, torch.int64, device, "ctx_hidden", tokens,
                     "one per ctx_hidden row")

    expect_arg(cos_sin_cache, "cos_sin_cache", (torch.float32,), 2, ALIGN["cos_sin_cache"],
               device, "ctx_hidden")
    if cos_sin_cache.shape[1] != head_dim or cos_sin_cache.shape[0] == 0:
        fail("cos_sin_cache", f"shape [max_pos >= 1, D = {head_dim}]",
             f"shape {tuple(cos_sin_cache.shape)}")
    if not cos_sin_cache.is_contiguous():
        fail("cos_sin_cache", "a contiguous tensor", f"strides {cos_sin_cache.stride()}")

    if (cache_loc_2d is None) != (commit_lens is None):
        missing = "commit_lens" if commit_lens is None else "cache_loc_2d"
        fail(missing, "a tensor: cache_loc_2d and commit_lens come together", None)
    if cache_loc_2d is not None:
        expect_arg(cache_loc_2d, "cache_loc_2d", (torch.int64,), 2, ALIGN["cache_loc_2d"],
                   device, "ctx_hidden", contiguous=True)
        if cache_loc_2d.numel() != tokens or cache_loc_2d.shape[1] == 0:
            fail("cache_loc_2d", f"shape [bs, W] with bs*W = T = {tokens}",
                 f"shape {tuple(cache_loc_2d.shape)}")
        expect_index(commit_lens, "commit_lens", torch.int32, device, "ctx_hidden",
                     cache_loc_2d.shape[0], "cache_loc_2d.shape[0]")

    arch = arch_for(device)
    check_overrides(arch)
    check_tile_layout(head_dim, kv)
    if arch is None:
        return None
    return StackedLayout(num_layers, n_kv, head_dim, bias is not None, cache_loc_2d is not None,
                         norm_dtype_name(k_norm_weight.dtype), arch)


check_stacked_kv_proj = stacked_kv_proj.check
