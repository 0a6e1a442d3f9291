"""The adapters on the GPU: what they write equals what the direct ``cute_kernels`` calls write
on the same inputs, byte for byte over the whole cache backings (same kernels, same
arguments), and SGLang's forced fallback equals the reference."""

from __future__ import annotations

import pytest
import torch
from test_integrations_cpu import (
    FORMATS,
    _stacked_from_layers,
    assert_same_bytes,
    assert_written,
    call_args,
    drafter,
    vllm_attn,
)

import cute_kernels
from cute_kernels import reference
from cute_kernels.integrations import sglang, vllm
from cute_kernels.testing import POISON
from cute_kernels.testing import kv_rope_insert_case as kv_case
from cute_kernels.testing import stacked_kv_proj_case as stacked_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_slots", [17, 1023])
@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_insert_context_kv_equals_the_direct_call(fmt, num_slots):
    case = kv_case(fmt, num_slots, 64, "cuda")
    twin_backing, twin_cache = case.twin()
    cute_kernels.kv_rope_insert(*case.args(twin_cache))
    vllm.insert_context_kv(vllm_attn(case), case.kv, case.positions, case.slot_mapping)
    torch.cuda.synchronize()
    assert (case.backing.view(torch.uint8) != POISON).any()
    assert_same_bytes([case.backing], [twin_backing])


@pytest.mark.parametrize("fmt", ["v4_packed", "fp8"])
def test_vllm_insert_context_kv_in_a_cuda_graph(fmt):
    """Captured once, replayed with new kv rows and a new fp8 scale: each replay equals a
    direct call on the new values."""
    case = kv_case(fmt, 257, 64, "cuda")
    attn = vllm_attn(case)
    vllm.insert_context_kv(attn, case.kv, case.positions, case.slot_mapping)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        vllm.insert_context_kv(attn, case.kv, case.positions, case.slot_mapping)
    twin_backing, twin_cache = case.twin()
    for _ in range(2):
        case.kv.normal_()
        if case.fp8_scale is not None:
            case.fp8_scale.mul_(1.5)
        case.poison()
        twin_backing.view(torch.uint8).fill_(POISON)
        graph.replay()
        cute_kernels.kv_rope_insert(*case.args(twin_cache))
        torch.cuda.synchronize()
        assert_same_bytes([case.backing], [twin_backing])


STACKED = [
    dict(tokens=64),
    dict(tokens=56, bias=True, commit=True, row_pad=8),
    dict(tokens=300, hidden=512, num_layers=5, n_kv=8),  # the Qwen3 drafter layout, small H
]


def _direct(case) -> tuple[list, list]:
    """The direct kernel call on twin caches, with the fp32 k-norm weight the adapter's
    parameters hold (so both run the same compiled variant)."""
    k_backings, v_backings, k_caches, v_caches = case.twin()
    args = list(case.args(k_caches, v_caches))
    args[3] = case.k_norm_weight.float()
    cute_kernels.stacked_kv_proj(*args)
    return k_backings, v_backings


@pytest.mark.parametrize("params", STACKED, ids=lambda p: ",".join(f"{k}={v}" for k, v in
                                                                   p.items()))
def test_sglang_write_target_hidden_kv_equals_the_direct_call(params):
    case = stacked_case(device="cuda", norm_dtype=torch.bfloat16, **params)
    want_k, want_v = _direct(case)
    assert sglang.write_target_hidden_kv(drafter(case), *call_args(case)) is None
    torch.cuda.synchronize()
    assert_written(case)
    assert_same_bytes([*case.k_backings, *case.v_backings], [*want_k, *want_v])


def test_sglang_prestacked_weight_equals_the_direct_call():
    case = stacked_case(56, device="cuda", norm_dtype=torch.bfloat16, commit=True)
    model = drafter(case)
    want_k, want_v = _direct(case)
    assert sglang.write_target_hidden_kv(model, *call_args(case), weight=case.weight) is None
    torch.cuda.synchronize()
    assert sglang.stacked_ctx_kv_params(model)[0].weight is case.weight
    assert_written(case)
    assert_same_bytes([*case.k_backings, *case.v_backings], [*want_k, *want_v])


def test_sglang_graph_replays_new_rows_and_refreshed_weights():
    """Captured once after the eager call that builds the parameters; replayed with new
    context rows, then after an in-place weight sync and ``refresh_stacked_ctx_kv_params``:
    each replay equals a direct call on the new values (the refresh writes into the storage
    the graph captured)."""
    case = stacked_case(64, device="cuda", norm_dtype=torch.bfloat16, bias=True)
    model = drafter(case)
    assert sglang.write_target_hidden_kv(model, *call_args(case)) is None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        sglang.write_target_hidden_kv(model, *call_args(case))
    for weight_sync in (False, True):
        case.ctx_hidden.normal_()
        if weight_sync:
            with torch.no_grad():
                for layer in model.layers:  # (the k-norm weights are views of the case's)
                    layer.self_attn.qkv_proj.weight.mul_(0.5)
                    layer.self_attn.qkv_proj.bias.add_(0.25)
                    layer.self_attn.k_norm.weight.mul_(-1)
                weight, bias, _ = _stacked_from_layers(model)
                case.weight.copy_(weight)
                case.bias.copy_(bias)
            assert sglang.refresh_stacked_ctx_kv_params(model)[1] is None
        case.poison()
        graph.replay()
        want_k, want_v = _direct(case)
        torch.cuda.synchronize()
        assert_written(case)
        assert_same_bytes([*case.k_backings, *case.v_backings], [*want_k, *want_v])


def test_sglang_forced_fallback_on_the_gpu_equals_the_reference():
    case = stacked_case(56, device="cuda", norm_dtype=torch.bfloat16, bias=True)
    ref_kb, ref_vb, ref_k, ref_v = case.twin()
    reference.stacked_kv_proj(*case.args(ref_k, ref_v))
    reason = sglang.write_target_hidden_kv(drafter(case), *call_args(case), force_fallback=True)
    torch.cuda.synchronize()
    assert reason == sglang.FORCED_FALLBACK
    assert_written(case)
    assert_same_bytes([*case.k_backings, *case.v_backings], [*ref_kb, *ref_vb])
