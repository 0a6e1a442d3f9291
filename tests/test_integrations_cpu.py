"""The drop-in adapters on the CPU, with stand-in modules carrying the engines' attributes:
which attributes they read, what they pass to the kernels (the kernel swapped for its
reference, compared byte for byte with a direct reference call), the kernels' own CPU
rejection, SGLang's fallback decisions and reasons, the per-model cache, the pre-stacked
weight, and the per-layer fallback against the reference."""

from __future__ import annotations

import gc
import re
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cute_kernels import LayoutError, reference
from cute_kernels.integrations import sglang, vllm
from cute_kernels.layouts import CacheFormat
from cute_kernels.testing import POISON, compare_stacked
from cute_kernels.testing import kv_rope_insert_case as kv_case
from cute_kernels.testing import stacked_kv_proj_case as stacked_case

FORMATS = [f.value for f in CacheFormat]

# -- stand-ins ------------------------------------------------------------------------------------


class Holder(nn.Module):
    """A module carrying the given attributes (tensors as plain attributes, like vLLM's bound
    cache tensors)."""

    def __init__(self, **attrs):
        super().__init__()
        for name, value in attrs.items():
            setattr(self, name, value)


def vllm_attn(case, **drop) -> Holder:
    """vLLM's DSpark attention layer as ``_insert_context_kv`` sees it; ``drop`` names
    attributes to leave out (``attn``, ``swa_cache_layer`` or ``rotary_emb`` level)."""
    cache_attrs = {"kv_cache": case.k_cache, "block_size": case.block_size}
    rotary_attrs = {"cos_sin_cache": case.cos_sin_cache}
    attrs = {"kv_mxfp8": case.kv_mxfp8}
    if case.fp8_scale is not None:
        attrs[vllm.FP8_SCALE_ATTR] = case.fp8_scale
    for name in drop:
        for group in (cache_attrs, rotary_attrs, attrs):
            group.pop(name, None)
    if "swa_cache_layer" not in drop:
        attrs["swa_cache_layer"] = Holder(**cache_attrs)
    if "rotary_emb" not in drop:
        attrs["rotary_emb"] = Holder(**rotary_attrs)
    return Holder(**attrs)


class QKVProj(nn.Module):
    """SGLang's QKVParallelLinear: weight [q + 2kv, H] (rows Q | K | V), forward -> (y, None)."""

    def __init__(self, weight, bias=None, quant_method=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.quant_method = quant_method

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class UnquantizedLinearMethod:  # matched by type name, as SGLang's slice check does
    pass


class Fp8LinearMethod:
    pass


class Fp8QKVProj(nn.Module):
    """A per-tensor fp8 QKV weight; forward dequantises (fp32 accumulation, one bf16 rounding)."""

    def __init__(self, weight):
        super().__init__()
        self.weight_scale = weight.float().abs().amax() / 448
        self.weight = nn.Parameter((weight.float() / self.weight_scale).to(torch.float8_e4m3fn),
                                   requires_grad=False)
        self.quant_method = Fp8LinearMethod()
        self.calls = 0

    def dequantised(self):
        return (self.weight.float() * self.weight_scale).to(torch.bfloat16)

    def forward(self, x):
        self.calls += 1
        return (x.float() @ self.dequantised().float().t()).to(torch.bfloat16), None


class KNorm(nn.Module):
    def __init__(self, weight, eps, eps_name="variance_epsilon"):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        setattr(self, eps_name, eps)


class Rotary(nn.Module):
    def __init__(self, table, neox=True):
        super().__init__()
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.is_neox_style = neox


class Attn(nn.Module):
    def __init__(self, qkv_proj, k_norm, rotary_emb, q_size, kv_size):
        super().__init__()
        self.qkv_proj, self.k_norm, self.rotary_emb = qkv_proj, k_norm, rotary_emb
        self.q_size, self.kv_size = q_size, kv_size


class Layer(nn.Module):
    def __init__(self, self_attn):
        super().__init__()
        self.self_attn = self_attn


class Drafter(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


def layer_kv(case, layer: int) -> slice:
    kv2 = 2 * case.k_caches[0].shape[1] * case.k_caches[0].shape[2]
    return slice(layer * kv2, (layer + 1) * kv2)


def drafter(case, *, q_heads=3, eps=None, bias_layers=None, fp8_layers=(), eps_name=None,
            tables=None) -> Drafter:
    """A DSpark drafter whose layers hold ``case``'s weights: per layer a QKV weight with
    random Q rows on top of the case's K/V rows (so the stacked weight equals
    ``case.weight``), the case's k-norm row and one shared NeoX rotary. ``eps``: per-layer
    eps; ``bias_layers``: layers that keep their bias (default all, when the case has one);
    ``fp8_layers``: layers with an fp8 QKV weight; ``tables``: per-layer RoPE tables."""
    n_kv, d = case.k_caches[0].shape[1:]
    hidden = case.ctx_hidden.shape[1]
    gen = torch.Generator(device=case.weight.device).manual_seed(7)
    rotary = Rotary(case.cos_sin_cache)
    layers = []
    for i in range(case.num_layers):
        q_rows = torch.randn(q_heads * d, hidden, generator=gen, device=case.weight.device)
        weight = torch.cat([q_rows.to(torch.bfloat16), case.weight[layer_kv(case, i)]])
        bias = None
        if case.bias is not None and (bias_layers is None or i in bias_layers):
            bias = torch.cat([torch.zeros(q_heads * d, dtype=torch.bfloat16,
                                          device=case.bias.device),
                              case.bias[layer_kv(case, i)]])
        qkv = Fp8QKVProj(weight) if i in fp8_layers else QKVProj(weight, bias)
        norm_eps = case.eps if eps is None else eps[i]
        k_norm = (KNorm(case.k_norm_weight[i], norm_eps) if eps_name is None
                  else KNorm(case.k_norm_weight[i], norm_eps, eps_name))
        rot = rotary if tables is None else Rotary(tables[i])
        layers.append(Layer(Attn(qkv, k_norm, rot, q_heads * d, n_kv * d)))
    return Drafter(layers)


def call_args(case) -> tuple:
    return (case.ctx_hidden, case.positions, case.cache_loc, case.k_caches, case.v_caches,
            case.cache_loc_2d, case.commit_lens)


def assert_same_bytes(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        mismatch = (g.view(torch.uint8) != w.view(torch.uint8)).sum()
        assert mismatch == 0, f"backing {i}: {int(mismatch)} bytes differ"


def assert_written(case) -> None:
    """The comparison is not vacuous: rows were written, and not every byte is poison."""
    assert case.written_rows()[0].numel() > 0
    assert any((b.view(torch.uint8) != POISON).any() for b in case.k_backings)


# -- vLLM ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_passes_the_layer_attributes_in_the_op_order(fmt, monkeypatch):
    """The kernel swapped for its reference: the adapter's cache bytes equal a direct
    reference call's, for every format (so the block size, the V4/V4.1 switch and the fp8
    scale reach the op in their places)."""
    monkeypatch.setattr(vllm, "kv_rope_insert", reference.kv_rope_insert)
    case = kv_case(fmt, 37, 16, "cpu")
    twin_backing, twin_cache = case.twin()
    reference.kv_rope_insert(*case.args(twin_cache))
    vllm.insert_context_kv(vllm_attn(case), case.kv, case.positions, case.slot_mapping)
    assert_same_bytes([case.backing], [twin_backing])
    assert (case.backing.view(torch.uint8) != POISON).any()


@pytest.mark.parametrize("fmt", ["bf16", "v4_packed", "v41_mxfp8"])
def test_vllm_reads_the_fp8_scale_only_for_an_fp8_cache(fmt, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm, "kv_rope_insert", lambda *args: calls.append(args))
    case = kv_case(fmt, 5, 16, "cpu")
    attn = vllm_attn(case)
    assert not hasattr(attn, vllm.FP8_SCALE_ATTR)
    vllm.insert_context_kv(attn, case.kv, case.positions, case.slot_mapping)
    (args,) = calls
    assert args[6] is None and args[7] is case.kv_mxfp8 and args[5] == case.block_size


def test_vllm_fp8_cache_without_its_scale_names_the_attribute():
    case = kv_case("fp8", 5, 16, "cpu")
    attn = vllm_attn(case, **{vllm.FP8_SCALE_ATTR: None})
    with pytest.raises(LayoutError, match=r"attn\._flashinfer_fp8_kv_scale: expected an attr"):
        vllm.insert_context_kv(attn, case.kv, case.positions, case.slot_mapping)


@pytest.mark.parametrize("missing, path", [
    ("swa_cache_layer", "attn.swa_cache_layer"),
    ("kv_cache", "attn.swa_cache_layer.kv_cache"),
    ("block_size", "attn.swa_cache_layer.block_size"),
    ("rotary_emb", "attn.rotary_emb"),
    ("cos_sin_cache", "attn.rotary_emb.cos_sin_cache"),
    ("kv_mxfp8", "attn.kv_mxfp8"),
])
def test_vllm_missing_attribute_is_named(missing, path):
    case = kv_case("bf16", 5, 16, "cpu")
    with pytest.raises(LayoutError, match=f"^{re.escape(path)}: expected an attr"):
        vllm.insert_context_kv(vllm_attn(case, **{missing: None}), case.kv, case.positions,
                               case.slot_mapping)


def test_vllm_on_cpu_tensors_raises_the_kernels_error():
    case = kv_case("v4_packed", 5, 16, "cpu")
    with pytest.raises(LayoutError, match="kv: expected a CUDA tensor"):
        vllm.insert_context_kv(vllm_attn(case), case.kv, case.positions, case.slot_mapping)
    assert (case.backing.view(torch.uint8) == POISON).all()


def test_vllm_layout_errors_are_the_kernels():
    """A V4.1 switch on a V4 (584-byte) cache: the kernel's record-width message."""
    case = kv_case("v4_packed", 5, 16, "cpu")
    attn = vllm_attn(case)
    attn.kv_mxfp8 = True
    with pytest.raises(LayoutError, match="k_cache: expected record width 528"):
        vllm.insert_context_kv(attn, case.kv, case.positions, case.slot_mapping)


# -- SGLang: the stacked parameters and their cache ---------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_sglang_params_are_the_stacked_kv_rows(bias):
    case = stacked_case(9, num_layers=3, bias=bias, norm_dtype=torch.bfloat16)
    model = drafter(case)
    params, reason = sglang.stacked_ctx_kv_params(model)
    assert reason is None
    assert torch.equal(params.weight, case.weight)
    assert (params.bias is None) if not bias else torch.equal(params.bias, case.bias)
    assert params.k_norm_weight.dtype == torch.float32
    assert torch.equal(params.k_norm_weight, case.k_norm_weight.float())
    assert params.eps == case.eps
    # the documented memory cost: a copy of L*2*kv rows x H x 2 bytes
    rows, hidden = case.weight.shape
    assert params.weight.untyped_storage().nbytes() == rows * hidden * 2
    for layer in model.layers:
        assert params.weight.data_ptr() != layer.self_attn.qkv_proj.weight.data_ptr()


def test_sglang_params_are_cached_per_model():
    case = stacked_case(9)
    model, other = drafter(case), drafter(case)
    first, _ = sglang.stacked_ctx_kv_params(model)
    assert sglang.stacked_ctx_kv_params(model)[0] is first
    assert sglang.stacked_ctx_kv_params(other)[0] is not first
    # built once: a later change of the model is not seen (the documented staleness)
    model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3
    params, reason = sglang.stacked_ctx_kv_params(model)
    assert params is first and reason is None


def _stacked_from_layers(model) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The layers' K/V rows, biases and k-norm weights as they are now, stacked."""
    attns = [layer.self_attn for layer in model.layers]
    rows = [slice(a.q_size, a.q_size + 2 * a.kv_size) for a in attns]
    weight = torch.cat([a.qkv_proj.weight[r] for a, r in zip(attns, rows, strict=True)])
    bias = None
    if attns[0].qkv_proj.bias is not None:
        bias = torch.cat([a.qkv_proj.bias[r] for a, r in zip(attns, rows, strict=True)])
    return weight, bias, torch.stack([a.k_norm.weight for a in attns]).float()


def test_sglang_refresh_copies_updated_weights_into_the_same_storage():
    """After an in-place weight sync the cached parameters are stale until refreshed; the
    refresh writes the new values into the same tensors (a captured graph's pointers stay
    valid) and takes a new eps."""
    model = drafter(stacked_case(9, num_layers=3, bias=True))
    params, _ = sglang.stacked_ctx_kv_params(model)
    pointers = (params.weight.data_ptr(), params.bias.data_ptr(),
                params.k_norm_weight.data_ptr())
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.weight.mul_(2)
            layer.self_attn.qkv_proj.bias.add_(1)
            layer.self_attn.k_norm.weight.mul_(-1)
            layer.self_attn.k_norm.variance_epsilon = 1e-3
    weight, bias, k_norm = _stacked_from_layers(model)
    assert not torch.equal(sglang.stacked_ctx_kv_params(model)[0].weight, weight)  # stale
    fresh, reason = sglang.refresh_stacked_ctx_kv_params(model)
    assert reason is None and sglang.stacked_ctx_kv_params(model)[0] is fresh
    assert (fresh.weight.data_ptr(), fresh.bias.data_ptr(),
            fresh.k_norm_weight.data_ptr()) == pointers
    assert torch.equal(fresh.weight, weight) and torch.equal(fresh.bias, bias)
    assert torch.equal(fresh.k_norm_weight, k_norm) and fresh.eps == 1e-3


def test_sglang_refresh_of_a_prestacked_weight():
    """A caller's pre-stacked weight stays the caller's: the refresh checks it against the
    layers again (a stale one raises) and refreshes the k-norm copy in place."""
    case = stacked_case(9, num_layers=2)
    model = drafter(case)
    stacked = case.weight.clone()
    params, _ = sglang.stacked_ctx_kv_params(model, weight=stacked)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.weight.mul_(2)
            layer.self_attn.k_norm.weight.mul_(3)
    with pytest.raises(LayoutError, match=r"^weight: expected rows \[0, "):
        sglang.refresh_stacked_ctx_kv_params(model)  # the caller has not restacked yet
    stacked.mul_(2)
    fresh, reason = sglang.refresh_stacked_ctx_kv_params(model)
    assert reason is None and fresh.weight is stacked
    assert fresh.k_norm_weight.data_ptr() == params.k_norm_weight.data_ptr()
    assert torch.equal(fresh.k_norm_weight, _stacked_from_layers(model)[2])


def test_sglang_rebuilt_parameters_stay_allocated():
    """Parameters a rebuild replaces (a new pre-stacked weight; a refresh whose shapes
    changed) are kept alive: a graph captured with them still reads them."""
    case = stacked_case(9, num_layers=2)
    model = drafter(case)
    copied, _ = sglang.stacked_ctx_kv_params(model)
    gone = weakref.ref(copied.weight)
    prestacked, _ = sglang.stacked_ctx_kv_params(model, weight=case.weight.clone())
    del copied
    gc.collect()
    assert gone() is not None and any(p.weight is gone() for p in sglang._RETIRED)
    for layer in model.layers:  # the drafter grows a bias: a new shape of parameters
        qkv = layer.self_attn.qkv_proj
        qkv.bias = nn.Parameter(torch.zeros(qkv.weight.shape[0], dtype=qkv.weight.dtype),
                                requires_grad=False)
    fresh, reason = sglang.refresh_stacked_ctx_kv_params(model)
    assert reason is None and fresh.bias is not None and fresh is not prestacked
    assert any(p is prestacked for p in sglang._RETIRED)


def test_sglang_refresh_without_an_entry_builds_one():
    model = drafter(stacked_case(9))
    params, reason = sglang.refresh_stacked_ctx_kv_params(model)
    assert reason is None and sglang.stacked_ctx_kv_params(model)[0] is params


def test_sglang_cache_does_not_keep_the_model_alive():
    model = drafter(stacked_case(9))
    assert sglang.stacked_ctx_kv_params(model)[1] is None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_sglang_prestacked_weight_is_used_without_a_copy():
    case = stacked_case(9, num_layers=3)
    model = drafter(case)
    copied, _ = sglang.stacked_ctx_kv_params(model)
    stacked = case.weight.clone()
    params, reason = sglang.stacked_ctx_kv_params(model, weight=stacked)
    assert reason is None and params is not copied  # a new weight rebuilds the entry
    assert params.weight is stacked and params.weight.data_ptr() == stacked.data_ptr()
    assert sglang.stacked_ctx_kv_params(model)[0] is params
    assert sglang.stacked_ctx_kv_params(model, weight=stacked)[0] is params


def test_sglang_wrong_prestacked_weight_raises():
    case = stacked_case(9, num_layers=3)
    model = drafter(case)
    swapped = torch.cat([case.weight[layer_kv(case, i)] for i in (1, 0, 2)])
    with pytest.raises(LayoutError, match=r"weight: expected rows \[0, 512\) equal to "
                                          r"model\.layers\[0\]"):
        sglang.stacked_ctx_kv_params(model, weight=swapped)
    with pytest.raises(LayoutError, match="weight: expected the layers' K/V rows stacked"):
        sglang.stacked_ctx_kv_params(model, weight=case.weight.float())


def test_sglang_eps_attribute_name_and_unquantized_method():
    case = stacked_case(9)
    model = drafter(case, eps_name="eps")
    model.layers[0].self_attn.qkv_proj.quant_method = UnquantizedLinearMethod()
    params, reason = sglang.stacked_ctx_kv_params(model)
    assert reason is None and params.eps == case.eps


def test_sglang_missing_attribute_is_named():
    model = drafter(stacked_case(9))
    del model.layers[1].self_attn.k_norm
    with pytest.raises(LayoutError, match=r"model\.layers\[1\]\.self_attn\.k_norm: expected an"):
        sglang.stacked_ctx_kv_params(model)


@pytest.mark.parametrize("value", [None, "8", 2.0, 0, True, [1]])
@pytest.mark.parametrize("attr", ["q_size", "kv_size"])
def test_sglang_sizes_of_the_wrong_type_are_named(attr, value):
    model = drafter(stacked_case(9))
    setattr(model.layers[1].self_attn, attr, value)
    with pytest.raises(LayoutError, match=rf"model\.layers\[1\]\.self_attn\.{attr}: expected a "
                                          "positive int"):
        sglang.stacked_ctx_kv_params(model)


@pytest.mark.parametrize("value", [None, 3, torch.zeros(())])
def test_sglang_layers_that_are_not_a_sequence_are_named(value):
    model = drafter(stacked_case(9))
    del model.layers
    model.layers = value
    with pytest.raises(LayoutError, match=r"^model\.layers: expected a sequence of draft layers"):
        sglang.stacked_ctx_kv_params(model)


def test_sglang_rope_layouts_neither_path_serves_raise():
    case = stacked_case(9)
    model = drafter(case)
    for style in (False, "gptj", 0):  # only True (or no attribute) is NeoX
        model.layers[0].self_attn.rotary_emb.is_neox_style = style
        with pytest.raises(LayoutError, match=r"rotary_emb\.is_neox_style: expected True"):
            sglang.stacked_ctx_kv_params(model)
    partial = drafter(case, tables=[case.cos_sin_cache[:, :64]] * case.num_layers)
    with pytest.raises(LayoutError, match=r"cos_sin_cache: expected a \[max_pos, D = 128\]"):
        sglang.write_target_hidden_kv(partial, *call_args(case), force_fallback=True)


# -- SGLang: dispatch -----------------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(), dict(bias=True, commit=True, row_pad=8)])
def test_sglang_supported_drafter_calls_the_kernel_with_the_stacked_params(params, monkeypatch):
    """The kernel swapped for its reference: one call, and the caches equal a direct reference
    call on the case's stacked arguments, byte for byte."""
    calls = []

    def kernel(*args):
        calls.append(args)
        reference.stacked_kv_proj(*args)

    monkeypatch.setattr(sglang, "stacked_kv_proj", kernel)
    case = stacked_case(56, num_layers=3, norm_dtype=torch.bfloat16, **params)
    ref_kb, ref_vb, ref_k, ref_v = case.twin()
    reference.stacked_kv_proj(*case.args(ref_k, ref_v))
    model = drafter(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sglang.write_target_hidden_kv(model, *call_args(case)) is None
    assert len(calls) == 1
    assert calls[0][1] is sglang.stacked_ctx_kv_params(model)[0].weight
    assert_written(case)
    assert_same_bytes([*case.k_backings, *case.v_backings], [*ref_kb, *ref_vb])


def test_sglang_on_cpu_tensors_raises_the_kernels_error():
    case = stacked_case(9)
    with pytest.raises(LayoutError, match="ctx_hidden: expected a CUDA tensor"):
        sglang.write_target_hidden_kv(drafter(case), *call_args(case))
    assert all((b.view(torch.uint8) == POISON).all() for b in case.k_backings)


def per_layer_reference(case, model, ref_k, ref_v) -> None:
    """The reference one layer at a time, with that layer's own eps, bias and RoPE table."""
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        bias = attn.qkv_proj.bias
        reference.stacked_kv_proj(
            case.ctx_hidden, case.weight[layer_kv(case, i)],
            None if bias is None else bias[attn.q_size:], case.k_norm_weight[i:i + 1],
            attn.k_norm.variance_epsilon, case.positions, attn.rotary_emb.cos_sin_cache,
            case.cache_loc, [ref_k[i]], [ref_v[i]], case.cache_loc_2d, case.commit_lens)


UNSUPPORTED = {
    "mixed_eps": (dict(), dict(eps=[1e-6, 1e-5, 1e-6]),
                  r"model\.layers\[1\]\.self_attn\.k_norm: eps 1e-05 differs from layer 0's"),
    "bias_on_some": (dict(bias=True), dict(bias_layers=[0, 2]),
                     r"qkv_proj\.bias on layers \[0, 2\] only, of 3"),
    "tables_differ": (dict(), dict(tables="shifted"),
                      r"layers\[1\]\.self_attn\.rotary_emb\.cos_sin_cache: differs"),
    "head_dim_96": (dict(head_dim=96), dict(),
                    r"the kernel's layout check: k_caches\[0\]: expected head dim"),
    "hidden_96": (dict(hidden=96), dict(),
                  r"the kernel's layout check: ctx_hidden: expected a hidden size"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_sglang_unsupported_drafter_falls_back_with_the_reason(name):
    case_params, drafter_params, reason_re = UNSUPPORTED[name]
    case = stacked_case(56, num_layers=3, commit=name == "bias_on_some",
                        norm_dtype=torch.bfloat16, **case_params)
    if drafter_params.get("tables") == "shifted":  # layer 1 rotates by other angles
        drafter_params = dict(tables=[case.cos_sin_cache, case.cos_sin_cache.roll(1, 0),
                                      case.cos_sin_cache])
    model = drafter(case, **drafter_params)
    params, reason = sglang.stacked_ctx_kv_params(model)
    assert params is None and reason is not None
    assert re.search(reason_re, reason), reason

    ref_kb, ref_vb, ref_k, ref_v = case.twin()
    per_layer_reference(case, model, ref_k, ref_v)
    with pytest.warns(RuntimeWarning, match="writes its context KV layer by layer"):
        assert sglang.write_target_hidden_kv(model, *call_args(case)) == reason
    assert_written(case)
    assert_same_bytes([*case.k_backings, *case.v_backings], [*ref_kb, *ref_vb])
    with warnings.catch_warnings():  # once per model
        warnings.simplefilter("error")
        assert sglang.write_target_hidden_kv(model, *call_args(case)) == reason


@pytest.mark.parametrize("method, reason", [
    (Fp8LinearMethod, "model.layers[1].self_attn.qkv_proj: quantised (quant_method "
                      "Fp8LinearMethod)"),
    (None, "model.layers[1].self_attn.qkv_proj.weight: quantised dtype torch.float8_e4m3fn"),
])
def test_sglang_fp8_layer_falls_back_through_its_module(method, reason):
    """A quantised layer (by its method, or by its weight dtype alone): None plus the reason;
    the fallback runs that layer's own qkv_proj (SGLang's fallback), the others sliced."""
    case = stacked_case(56, num_layers=3, norm_dtype=torch.bfloat16)
    model = drafter(case, fp8_layers=(1,))
    fp8 = model.layers[1].self_attn.qkv_proj
    fp8.quant_method = None if method is None else method()
    assert sglang.stacked_ctx_kv_params(model) == (None, f"not sliceable: {reason}")

    stacked = case.weight.clone()
    stacked[layer_kv(case, 1)] = fp8.dequantised()[model.layers[1].self_attn.q_size:]
    _, _, ref_k, ref_v = case.twin()
    reference.stacked_kv_proj(case.ctx_hidden, stacked, None, case.k_norm_weight, case.eps,
                              case.positions, case.cos_sin_cache, case.cache_loc, ref_k, ref_v)
    with pytest.warns(RuntimeWarning, match="quantised"):
        sglang.write_target_hidden_kv(model, *call_args(case))
    assert fp8.calls == 1
    assert_written(case)
    result = compare_stacked(case, ref_k, ref_v)  # the module's own rounding: within tolerance
    assert result.untouched_equal and result.within_one_ulp >= 0.999


@pytest.mark.parametrize("params", [dict(), dict(bias=True, commit=True, row_pad=8),
                                    dict(head_dim=64, n_kv=3, skip_every=0)])
def test_sglang_forced_fallback_equals_the_reference(params):
    case = stacked_case(56, num_layers=3, norm_dtype=torch.bfloat16, **params)
    ref_kb, ref_vb, ref_k, ref_v = case.twin()
    reference.stacked_kv_proj(*case.args(ref_k, ref_v))
    with warnings.catch_warnings():  # the caller's choice: no warning
        warnings.simplefilter("error")
        reason = sglang.write_target_hidden_kv(drafter(case), *call_args(case),
                                               force_fallback=True)
    assert reason == sglang.FORCED_FALLBACK
    assert_written(case)
    assert_same_bytes([*case.k_backings, *case.v_backings], [*ref_kb, *ref_vb])


def test_sglang_fallback_checks_the_caches():
    case = stacked_case(9, num_layers=3)
    model = drafter(case)
    args = list(call_args(case))
    args[3] = case.k_caches[:2]
    with pytest.raises(LayoutError, match=r"k_caches: expected 3 tensors \(one per draft"):
        sglang.write_target_hidden_kv(model, *args, force_fallback=True)
    args[3] = [c.to(torch.float16) for c in case.k_caches]
    with pytest.raises(LayoutError, match=r"k_caches\[0\]: expected dtype torch.bfloat16"):
        sglang.write_target_hidden_kv(model, *args, force_fallback=True)


def test_sglang_fallback_with_no_written_rows_writes_nothing():
    case = stacked_case(9, skip_every=1)  # every slot -1
    reason = sglang.write_target_hidden_kv(drafter(case), *call_args(case), force_fallback=True)
    assert reason == sglang.FORCED_FALLBACK
    assert all((b.view(torch.uint8) == POISON).all()
               for b in (*case.k_backings, *case.v_backings))
