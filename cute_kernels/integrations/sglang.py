"""SGLang: the DSpark/DFlash drafter's context-KV write (SGLang's ``models/dspark.py``:
``_stacked_ctx_kv_params`` and ``write_target_hidden_kv``).

Swapping it in, inside the drafter's ``write_target_hidden_kv`` (SGLang's pool hands out one K
and one V buffer per draft layer)::

    ctx_hidden = self.project_target_hidden(target_hidden)
    ids = [layer.self_attn.attn.layer_id for layer in self.layers]
    write_target_hidden_kv(self, ctx_hidden, positions, cache_loc,
                           [pool.get_key_buffer(i) for i in ids],
                           [pool.get_value_buffer(i) for i in ids],
                           cache_loc_2d, commit_lens)

What is read from the drafter (``model.layers[i].self_attn``, duck-typed):
``qkv_proj.weight`` ``[q_size + 2*kv_size, H]`` (rows Q | K | V), ``qkv_proj.bias`` (optional),
``qkv_proj.quant_method`` (optional: absent, None or ``UnquantizedLinearMethod`` means
unquantised), ``q_size``, ``kv_size``, ``k_norm.weight`` ``[D]``, ``k_norm.variance_epsilon``
(or ``k_norm.eps``), ``rotary_emb.cos_sin_cache`` ``[max_pos, D]`` and
``rotary_emb.is_neox_style`` (True when absent, SGLang's default). Both paths rotate NeoX
halves over the whole head: a GPT-J-style RoPE or a table narrower than the head raises
:class:`~cute_kernels.LayoutError` (keep SGLang's own path for such a drafter).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch
from torch import nn

from .. import reference
from ..arch import arch_for
from ..stacked_kv_proj import check_stacked_kv_proj, stacked_kv_proj
from ..stacked_kv_proj.interface import ALIGN
from ..validation import (
    LayoutError,
    describe,
    expect_base_aligned,
    expect_dtype,
    expect_positive_int,
    expect_tensor,
    fail,
)
from . import require_attr

#: The reason :func:`write_target_hidden_kv` returns for ``force_fallback=True``.
FORCED_FALLBACK = "force_fallback=True: the caller asked for the per-layer PyTorch path"


@dataclasses.dataclass(frozen=True)
class StackedCtxKvParams:
    """The drafter's stacked K/V projection parameters, as :func:`cute_kernels.stacked_kv_proj`
    takes them (specs/stacked_kv_proj.md). Built once per model by
    :func:`stacked_ctx_kv_params`."""

    weight: torch.Tensor  # [L*2*kv, H]: per layer its K rows, then its V rows
    bias: torch.Tensor | None  # [L*2*kv], or None when no layer has a bias
    k_norm_weight: torch.Tensor  # fp32 [L, D]
    eps: float  # the one k-norm eps of every layer


@dataclasses.dataclass(frozen=True)
class _Layer:
    """The attributes of one draft layer that the adapter uses."""

    path: str  # "model.layers[i].self_attn", for the messages
    qkv_proj: nn.Module
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    q_size: int
    kv_size: int
    head_dim: int
    k_norm_weight: torch.Tensor
    eps: float
    cos_sin_cache: torch.Tensor
    not_sliceable: str | None  # why the K/V rows cannot be sliced out of ``weight``

    @property
    def kv_rows(self) -> slice:
        return slice(self.q_size, self.q_size + 2 * self.kv_size)


def _why_not_sliceable(qkv: object, weight: object, q_size: int, kv_size: int,
                       path: str) -> str | None:
    """SGLang's ``can_dflash_slice_qkv_weight`` rule (an unquantised method and a weight), plus
    the weight dtype and row count the slice relies on."""
    quant = getattr(qkv, "quant_method", None)
    if quant is not None and type(quant).__name__ != "UnquantizedLinearMethod":
        return f"{path}.qkv_proj: quantised (quant_method {type(quant).__name__})"
    if not isinstance(weight, torch.Tensor):
        return f"{path}.qkv_proj: no weight tensor to slice"
    if not weight.dtype.is_floating_point or weight.element_size() < 2:
        return f"{path}.qkv_proj.weight: quantised dtype {weight.dtype}"
    if weight.dim() != 2 or weight.shape[0] != q_size + 2 * kv_size:
        return (f"{path}.qkv_proj.weight: shape {tuple(weight.shape)}, not "
                f"[q_size + 2*kv_size = {q_size + 2 * kv_size}, H]")
    return None


def _read_layers(model: nn.Module) -> list[_Layer]:
    """Every draft layer's attributes; a missing one raises LayoutError naming it."""
    out = []
    layers = require_attr(model, "layers", "model")
    try:
        layers = list(layers)
    except TypeError:
        fail("model.layers", "a sequence of draft layers", describe(layers))
    for i, layer in enumerate(layers):
        path = f"model.layers[{i}].self_attn"
        attn = require_attr(layer, "self_attn", f"model.layers[{i}]")
        qkv = require_attr(attn, "qkv_proj", path)
        q_size = expect_positive_int(require_attr(attn, "q_size", path), f"{path}.q_size")
        kv_size = expect_positive_int(require_attr(attn, "kv_size", path), f"{path}.kv_size")
        k_norm = require_attr(attn, "k_norm", path)
        norm_weight = expect_tensor(require_attr(k_norm, "weight", f"{path}.k_norm"),
                                    f"{path}.k_norm.weight")
        if norm_weight.dim() != 1:
            fail(f"{path}.k_norm.weight", "a 1-D tensor [D]", describe(norm_weight))
        # SGLang's RMSNorm names it variance_epsilon; other norms (and stand-ins) say eps
        eps = getattr(k_norm, "variance_epsilon", getattr(k_norm, "eps", None))
        if eps is None:
            fail(f"{path}.k_norm.variance_epsilon", "an attribute (or k_norm.eps)",
                 f"a {type(k_norm).__name__} without either")
        head_dim = norm_weight.shape[0]
        rotary = require_attr(attn, "rotary_emb", path)
        # Both paths (kernel and fallback) rotate NeoX halves over the whole head: other RoPE
        # layouts are not a fallback case but a drafter this adapter does not serve.
        neox = getattr(rotary, "is_neox_style", True)
        if neox is not True:
            fail(f"{path}.rotary_emb.is_neox_style", "True (NeoX RoPE)", describe(neox))
        table = expect_tensor(require_attr(rotary, "cos_sin_cache", f"{path}.rotary_emb"),
                              f"{path}.rotary_emb.cos_sin_cache")
        if table.dim() != 2 or table.shape[1] != head_dim:
            fail(f"{path}.rotary_emb.cos_sin_cache",
                 f"a [max_pos, D = {head_dim}] table (RoPE over the whole head)", describe(table))
        weight = getattr(qkv, "weight", None)
        out.append(_Layer(
            path=path, qkv_proj=qkv, weight=weight, bias=getattr(qkv, "bias", None),
            q_size=q_size, kv_size=kv_size, head_dim=head_dim, k_norm_weight=norm_weight,
            eps=eps, cos_sin_cache=table,
            not_sliceable=_why_not_sliceable(qkv, weight, q_size, kv_size, path),
        ))
    return out


def _same_table(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                      and torch.equal(a, b))


def _unsupported(layers: list[_Layer]) -> str | None:
    """Why one stacked call cannot stand for these layers: SGLang's ``_stacked_ctx_kv_params``
    rules (sliceable, one eps, bias on all layers or none), then what one call shares across
    layers (shapes, one RoPE table: the kernel reads layer 0's, as SGLang's stacked path
    does)."""
    if not layers:
        return "model.layers: no draft layers"
    first = layers[0]
    for layer in layers:
        if layer.not_sliceable is not None:
            return f"not sliceable: {layer.not_sliceable}"
    for layer in layers[1:]:
        if layer.eps != first.eps:
            return (f"{layer.path}.k_norm: eps {layer.eps} differs from layer 0's {first.eps} "
                    "(one eps for all layers)")
    with_bias = [i for i, layer in enumerate(layers) if layer.bias is not None]
    if 0 < len(with_bias) < len(layers):
        return (f"qkv_proj.bias on layers {with_bias} only, of {len(layers)} "
                "(a bias on all layers or none)")
    shape = (first.kv_size, first.head_dim, first.weight.shape[1], first.weight.dtype)
    for layer in layers:
        if (layer.kv_size, layer.head_dim, layer.weight.shape[1], layer.weight.dtype) != shape:
            return (f"{layer.path}: (kv_size, D, H, dtype) "
                    f"{(layer.kv_size, layer.head_dim, layer.weight.shape[1], layer.weight.dtype)}"
                    f" differ from layer 0's {shape}")
        if not _same_table(layer.cos_sin_cache, first.cos_sin_cache):
            return (f"{layer.path}.rotary_emb.cos_sin_cache: differs from layer 0's (one table "
                    "for all layers)")
    if first.kv_size % first.head_dim:
        return f"{first.path}: kv_size {first.kv_size} is not a multiple of D {first.head_dim}"
    return None


def _expect_stacked(weight: object, layers: list[_Layer]) -> None:
    """A caller's pre-stacked weight holds exactly the layers' K/V rows in the kernel's order
    (compared once, when the parameters are built): anything else is a caller bug, raised."""
    first = layers[0]
    kv2 = 2 * first.kv_size
    expect_tensor(weight, "weight")
    want = (len(layers) * kv2, first.weight.shape[1])
    if (tuple(weight.shape) != want or weight.dtype != first.weight.dtype
            or weight.device != first.weight.device):
        fail("weight", f"the layers' K/V rows stacked: a {first.weight.dtype} tensor of shape "
             f"{want} on {first.weight.device}", describe(weight))
    for i, layer in enumerate(layers):
        if not torch.equal(weight[i * kv2:(i + 1) * kv2], layer.weight[layer.kv_rows]):
            fail("weight", f"rows [{i * kv2}, {(i + 1) * kv2}) equal to "
                 f"{layer.path}.qkv_proj.weight[{layer.kv_rows.start}:{layer.kv_rows.stop}] "
                 "(per layer its K rows, then its V rows)", "rows that differ")


def _kernel_rejects(layers: list[_Layer], weight: torch.Tensor | None) -> str | None:
    """The kernel's own reason, from :func:`cute_kernels.check_stacked_kv_proj` on ``meta``
    tensors of the shapes the parameters will have (before the weight is copied) and
    one-row stand-ins for the per-call tensors, plus the arch of the weights' device."""
    first = layers[0]
    num_layers, d, hidden = len(layers), first.head_dim, first.weight.shape[1]
    rows = num_layers * 2 * first.kv_size

    def meta(shape: tuple, dtype: torch.dtype, stride: tuple | None = None) -> torch.Tensor:
        if stride is None:
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")

    if weight is None:
        w = meta((rows, hidden), first.weight.dtype)  # the copy is contiguous
    else:
        w = meta(tuple(weight.shape), weight.dtype, weight.stride())
    bias = None if first.bias is None else meta((rows,), first.bias.dtype)
    table = first.cos_sin_cache
    caches = [meta((1, first.kv_size // d, d), torch.bfloat16) for _ in layers]
    index = meta((1,), torch.int64)
    try:
        check_stacked_kv_proj(meta((1, hidden), torch.bfloat16), w, bias,
                              meta((num_layers, d), torch.float32), first.eps, index,
                              meta(tuple(table.shape), table.dtype, table.stride()), index,
                              caches, caches)
        if weight is not None:
            expect_base_aligned(weight, "weight", ALIGN["weight"])
        arch_for(first.weight.device)  # an unsupported GPU fails here, with the kernel's text
    except LayoutError as err:
        return f"the kernel's layout check: {err}"
    return None


def _build(model: nn.Module, weight: torch.Tensor | None
           ) -> tuple[StackedCtxKvParams | None, str | None]:
    layers = _read_layers(model)
    reason = _unsupported(layers)
    if reason is not None:
        return None, reason
    if weight is not None:
        _expect_stacked(weight, layers)
    reason = _kernel_rejects(layers, weight)
    if reason is not None:
        return None, reason
    with torch.no_grad():  # plain tensors, never part of an autograd graph
        if weight is None:
            weight = torch.cat([layer.weight[layer.kv_rows] for layer in layers])
        bias = None
        if layers[0].bias is not None:
            bias = torch.cat([layer.bias[layer.kv_rows] for layer in layers])
        k_norm = torch.stack([layer.k_norm_weight for layer in layers]).float()
    return StackedCtxKvParams(weight, bias, k_norm, float(layers[0].eps)), None


@dataclasses.dataclass
class _Entry:
    params: StackedCtxKvParams | None
    reason: str | None
    weight_key: tuple | None  # the pre-stacked weight it was built with, None for none
    warned: bool = False


# Per model, for its lifetime only (a weak key: the cache never keeps a drafter alive; the
# entries hold tensors, never the model's modules).
_ENTRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Parameters an entry held before a rebuild replaced them: kept for the process's lifetime, as
# a CUDA graph captured with them reads their storage at every replay (the op's workspaces are
# kept the same way).
_RETIRED: list[StackedCtxKvParams] = []


def _weight_key(weight: torch.Tensor | None) -> tuple | None:
    if weight is None:
        return None
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device)


def _cached(model: nn.Module) -> _Entry | None:
    try:
        return _ENTRIES.get(model)
    except TypeError:
        fail("model", "an object that supports weak references (an nn.Module)", describe(model))


def _tensors(params: StackedCtxKvParams | None) -> tuple:
    return () if params is None else (params.weight, params.bias, params.k_norm_weight)


def _replace(model: nn.Module, old: _Entry | None, new: _Entry) -> _Entry:
    """Cache ``new`` for ``model``, retiring ``old``'s parameters unless ``new`` holds every
    one of their tensors (a refresh in place)."""
    kept = [id(t) for t in _tensors(new.params)]
    if old is not None and any(id(t) not in kept for t in _tensors(old.params) if t is not None):
        _RETIRED.append(old.params)
    _ENTRIES[model] = new
    return new


def _entry(model: nn.Module, weight: torch.Tensor | None) -> _Entry:
    entry = _cached(model)
    if entry is None or (weight is not None and _weight_key(weight) != entry.weight_key):
        entry = _replace(model, entry, _Entry(*_build(model, weight), _weight_key(weight)))
    return entry


def _same_storage_layout(a: StackedCtxKvParams, b: StackedCtxKvParams) -> bool:
    """Whether ``b``'s tensors fit ``a``'s storage: the same shapes, dtypes and devices."""
    def meta(t: torch.Tensor | None) -> tuple | None:
        return None if t is None else (tuple(t.shape), t.dtype, t.device)

    return all(meta(x) == meta(y) for x, y in zip(_tensors(a), _tensors(b), strict=True))


def stacked_ctx_kv_params(
    model: nn.Module, weight: torch.Tensor | None = None
) -> tuple[StackedCtxKvParams | None, str | None]:
    """``(params, None)`` for one :func:`cute_kernels.stacked_kv_proj` call over all of
    ``model.layers``, or ``(None, reason)`` — built the way SGLang's ``_stacked_ctx_kv_params``
    builds its stacked parameters, and cached per model (the second call returns the same
    object; a ``None`` decision is kept too, as SGLang's is).

    ``None`` when a layer's QKV weight is quantised (a quant method other than
    ``UnquantizedLinearMethod``, or a weight dtype of one byte / not floating point) or not
    sliceable, the layers' k-norm eps differ, a bias is on some layers only, the layers differ
    in shape or RoPE table, or the kernel's layout check rejects the
    stacked shapes (its own message: e.g. a head dim outside {64, 128, 256}, a non-bf16 weight,
    ``H`` not a multiple of 64, an unsupported GPU).

    **Memory.** The stacked weight is a copy of every layer's K/V rows: ``L*2*kv`` rows x ``H``
    x 2 bytes (bf16), 10240 x 4096 x 2 = 84 MB for the Qwen3-8B drafter at TP1 (L = 5,
    kv = 8 x 128, H = 4096), held as long as the model lives. To avoid it pass ``weight``, a
    tensor that already holds those rows (per layer its K rows, then its V rows; e.g. the stack
    SGLang has built already): it is checked once against the layers (shape, dtype, device,
    values) and used as it is, without a copy. A different ``weight`` on a later call rebuilds
    the entry; ``weight=None`` returns what is cached.

    The copies (weight unless given, bias ``[L*2*kv]``, fp32 k-norm weight ``[L, D]``) are taken
    once, so they are stale after an in-place weight update (an RL weight sync), like
    SGLang's: call :func:`refresh_stacked_ctx_kv_params` after one. The RoPE table is not
    copied: :func:`write_target_hidden_kv` reads layer 0's ``rotary_emb.cos_sin_cache`` at
    every call (SGLang may rebind it to a longer table).

    The first call (the build) allocates, and compares tables and a given ``weight`` on the
    device: make it before CUDA-graph capture. Missing attributes (and the RoPE layouts neither
    path serves, see the module doc) raise :class:`~cute_kernels.LayoutError` naming them.
    """
    entry = _entry(model, weight)
    return entry.params, entry.reason


def refresh_stacked_ctx_kv_params(
    model: nn.Module,
) -> tuple[StackedCtxKvParams | None, str | None]:
    """Rebuild ``model``'s cached stacked parameters from its layers after their weights,
    biases, k-norm weights or eps changed in place (an RL weight sync, ``load_weights``): what
    SGLang's ``refresh_derived_weight_caches`` does for its own stack. Returns what
    :func:`stacked_ctx_kv_params` returns from then on.

    Where the stacked shapes did not change, the new values are copied into the cached tensors'
    own storage, so a CUDA graph captured before replays with them. The eps is a kernel
    argument, which a graph captures by value: re-capture after an eps change. A pre-stacked
    ``weight`` given to :func:`stacked_ctx_kv_params` is the caller's to update; it is compared
    with the layers again (a :class:`~cute_kernels.LayoutError` if it no longer holds their
    rows), and the bias and k-norm copies are refreshed. Where the shapes or the decision
    changed, the entry is rebuilt; the tensors it replaces stay allocated (for graphs captured
    with them). A model without a cached entry is built as by :func:`stacked_ctx_kv_params`.
    The rebuild allocates and compares on the device: not during graph capture."""
    entry = _cached(model)
    if entry is None:
        return stacked_ctx_kv_params(model)
    old = entry.params
    given = old.weight if old is not None and entry.weight_key is not None else None
    params, reason = _build(model, given)
    if old is not None and params is not None and _same_storage_layout(old, params):
        with torch.no_grad():
            for kept, fresh in zip(_tensors(old), _tensors(params), strict=True):
                if kept is not None and kept is not fresh:
                    kept.copy_(fresh)
        params = dataclasses.replace(old, eps=params.eps)
    fresh_entry = _replace(model, entry, _Entry(params, reason, _weight_key(given)))
    return fresh_entry.params, fresh_entry.reason


def _write_per_layer(
    layers: list[_Layer],
    ctx_hidden: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None,
    commit_lens: torch.Tensor | None,
) -> None:
    """SGLang's per-layer path (one projection, k-norm and RoPE per layer, each with its own
    weights, eps and table) with the kernel's row rules and the reference's rounding points:
    a sliceable layer gives the same cache contents as :func:`cute_kernels.reference.
    stacked_kv_proj` on the stacked weights. A quantised layer runs its own ``qkv_proj``
    module (SGLang's fallback), whose rounding is its own. Syncs with the host."""
    for arg, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        if len(caches) != len(layers):
            fail(arg, f"{len(layers)} tensors (one per draft layer)", len(caches))
        for i, cache in enumerate(caches):
            # the reference's rounding points end in bf16; other pools need their own scales
            expect_dtype(expect_tensor(cache, f"{arg}[{i}]"), f"{arg}[{i}]", torch.bfloat16)
    rows, slots = reference.stacked_kv_slots(cache_loc, cache_loc_2d, commit_lens)
    if rows.numel() == 0:
        return
    x = ctx_hidden[rows]  # only the rows that write, as the reference does
    pos = positions[rows]
    with torch.no_grad():
        for layer, k_cache, v_cache in zip(layers, k_caches, v_caches, strict=True):
            kv, d = layer.kv_size, layer.head_dim
            if layer.not_sliceable is None:
                bias = None if layer.bias is None else layer.bias[layer.kv_rows]
                y = reference._gemm_r1(x, layer.weight[layer.kv_rows], bias)  # R1, as the spec
            else:
                out = layer.qkv_proj(x)  # SGLang's linear layers return (output, bias)
                y = (out[0] if isinstance(out, tuple) else out)[:, layer.kv_rows]
            # a row whose position lies outside the layer's table writes nothing
            keep = reference.in_table(pos, layer.cos_sin_cache)
            y, at = y[keep], slots[keep]
            table = layer.cos_sin_cache[pos[keep]]
            cos = table[:, None, :d // 2].float()
            sin = table[:, None, d // 2:].float()
            k = y[:, :kv].reshape(-1, kv // d, d)
            reference.store_rows(
                k_cache, at, reference.k_norm_rope(k, layer.k_norm_weight, layer.eps, cos, sin))
            reference.store_rows(v_cache, at, y[:, kv:].reshape(-1, kv // d, d))


def write_target_hidden_kv(
    model: nn.Module,
    ctx_hidden: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None = None,
    commit_lens: torch.Tensor | None = None,
    *,
    weight: torch.Tensor | None = None,
    force_fallback: bool = False,
) -> str | None:
    """Project ``ctx_hidden`` through every draft layer's K/V weights, k-norm and NeoX-rotate
    the K heads and write K/V rows into the per-layer caches: SGLang's DSpark
    ``write_target_hidden_kv`` after its ``project_target_hidden`` step.

    ``ctx_hidden`` bf16 ``[T, H]``, ``positions`` and ``cache_loc`` int64 ``[T]``, optional
    ``cache_loc_2d`` int64 ``[bs, W]`` with ``commit_lens`` int32 ``[bs]`` (they replace
    ``cache_loc``: row ``t`` writes only when ``t mod W < commit_lens[t div W]``); a negative
    slot skips a row. ``k_caches``/``v_caches``: one bf16 ``[slots, n_kv, D]`` tensor per layer,
    in ``model.layers`` order.

    Returns None when :func:`cute_kernels.stacked_kv_proj` wrote the caches (one launch, with
    :func:`stacked_ctx_kv_params`'s cached parameters; ``weight`` is passed on to it). Otherwise
    returns why not — the reason of :func:`stacked_ctx_kv_params`, or :data:`FORCED_FALLBACK`
    when ``force_fallback`` (for debugging) — after writing the same rows with a per-layer
    PyTorch path (bf16 caches only; it syncs with the host, so it cannot be captured in a CUDA
    graph). A drafter-level reason is also warned (``RuntimeWarning``) once per model.

    Per-call layout errors are not routed to the fallback: a layout the kernel rejects for this
    call (a cache stride, a dtype, CPU tensors: ``ctx_hidden: expected a CUDA tensor``) raises
    its :class:`~cute_kernels.LayoutError`; ``force_fallback=True`` runs the PyTorch path on
    the CPU.
    """
    if force_fallback:
        reason = FORCED_FALLBACK
    else:
        entry = _entry(model, weight)
        params, reason = entry.params, entry.reason
        if params is not None:
            # read at every call: SGLang may rebind the table to a longer one
            table = model.layers[0].self_attn.rotary_emb.cos_sin_cache
            stacked_kv_proj(ctx_hidden, params.weight, params.bias, params.k_norm_weight,
                            params.eps, positions, table, cache_loc, k_caches, v_caches,
                            cache_loc_2d, commit_lens)
            return None
        if not entry.warned:
            entry.warned = True
            warnings.warn(f"cute_kernels.integrations.sglang: {type(model).__name__} writes its "
                          f"context KV layer by layer in PyTorch: {reason}", RuntimeWarning,
                          stacklevel=2)
    _write_per_layer(_read_layers(model), ctx_hidden, positions, cache_loc, k_caches, v_caches,
                     cache_loc_2d, commit_lens)
    return reason


__all__ = ["FORCED_FALLBACK", "StackedCtxKvParams", "refresh_stacked_ctx_kv_params",
           "stacked_ctx_kv_params", "write_target_hidden_kv"]
