"""C128 compressor kernel against the float64 reference on the GPU, with the tolerance rules of
specs/compress_c128.md."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.layouts import C128_FORMATS
from cute_kernels.testing import compress_c128_case as make_case

FORMATS = [f.value for f in C128_FORMATS]

pytestmark = pytest.mark.gpu


def _written_mask(case) -> torch.Tensor:
    """Bytes the reference writes: those that differ from the poison under two poisons."""
    masks = []
    for poison in (0xA5, 0x5A):
        backing, cache = case.fresh_cache(poison)
        reference.compress_c128(*case.args(cache))
        masks.append(backing.view(torch.uint8) != poison)
    return masks[0] | masks[1]


def _e4m3_step(value: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 codes at |value| (in the code's own scale)."""
    exp = torch.floor(torch.log2(value.abs().clamp_min(2.0**-6)))
    return torch.pow(2.0, exp - 3)


def _bf16_ulp(value: torch.Tensor) -> torch.Tensor:
    exp = torch.floor(torch.log2(value.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exp - 7)


def _bf16_tolerance(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp, with a floor for values near zero: the pooled sum cancels, and its fp32
    error (~2^-20 of the row's largest value) exceeds a tiny value's own ulp."""
    floor = ref.abs().amax(dim=-1, keepdim=True) * 2.0**-16
    return torch.maximum(_bf16_ulp(ref), floor)


def _records(case, backing: torch.Tensor):
    """(codes-or-values region, scale region) of every boundary token's record."""
    tokens = torch.nonzero(case.boundary).flatten()
    slots = case.kv_slot_mapping[tokens]
    kb = case.kv_block_size
    elem = case.k_cache.element_size()
    page = (slots // kb) * case.k_cache.stride(0) * elem
    row = slots % kb
    flat = backing.view(torch.uint8)

    def take(start, n):
        return flat[start.unsqueeze(1) + torch.arange(n, device=flat.device)]

    if case.k_cache.dtype == torch.uint8:
        return tokens, take(page + row * 576, 576), take(page + kb * 576 + row * 8, 8)
    return tokens, take(page + row * case.k_cache.stride(1) * elem, 512 * elem), None


def _check(case, got_backing: torch.Tensor) -> None:
    written = _written_mask(case)
    got = got_backing.view(torch.uint8)
    assert bool((got[~written] == 0xA5).all()), "bytes outside the records changed"
    ref_backing, ref_cache = case.fresh_cache()
    reference.compress_c128(*case.args(ref_cache))
    tokens, got_data, got_scales = _records(case, got_backing)
    _, ref_data, ref_scales = _records(case, ref_backing)
    if tokens.numel() == 0:
        return
    if case.k_cache.dtype == torch.uint8:
        # scale bytes exact, except where amax/448 is within 1e-6 of a power of two
        y = reference.c128_normed_windows(case.state_cache, case.block_table, case.token_to_req,
                                          case.positions, case.norm_weight, case.eps, tokens)
        amax = y[:, :448].to(torch.bfloat16).double().reshape(-1, 7, 64).abs().amax(-1)
        q = torch.log2(amax.clamp_min(1e-4) / 448.0)
        ratio = torch.pow(2.0, q)
        near_pow2 = (torch.pow(2.0, q.round()) - ratio).abs() <= 1e-6 * ratio
        scale_ok = (got_scales[:, :7] == ref_scales[:, :7]) | near_pow2
        assert bool(scale_ok.all()), "scale bytes differ"
        assert bool((got_scales[:, 7] == 0).all()), "pad byte"
        # every decoded fp8 value within one fp8 step of the reference
        def decode(data, scales):
            codes = data[:, :448].contiguous().view(torch.float8_e4m3fn).double()
            codes = codes.reshape(-1, 7, 64)
            return codes, torch.pow(2.0, scales[:, :7].double() - 127).unsqueeze(-1)
        got_codes, got_scale = decode(got_data, got_scales)
        ref_codes, ref_scale = decode(ref_data, ref_scales)
        step = _e4m3_step(ref_codes) * torch.maximum(got_scale, ref_scale)
        err = (got_codes * got_scale - ref_codes * ref_scale).abs()
        assert bool((err <= step * (1 + 1e-9)).all()), f"fp8 value off by {(err / step).max()}"
        got_rope = got_data[:, 448:].contiguous().view(torch.bfloat16).double()
        ref_rope = ref_data[:, 448:].contiguous().view(torch.bfloat16).double()
        rope_err = (got_rope - ref_rope).abs() / _bf16_tolerance(ref_rope)
        assert bool((rope_err <= 1 + 1e-9).all()), f"bf16 RoPE off by {rope_err.max()} tolerances"
    elif case.k_cache.dtype == torch.bfloat16:
        g = got_data.contiguous().view(torch.bfloat16).double()
        r = ref_data.contiguous().view(torch.bfloat16).double()
        err = (g - r).abs() / _bf16_tolerance(r)
        worst = int(err.flatten().argmax())
        assert bool((err <= 1 + 1e-9).all()), (
            f"bf16 value off by {err.max()} tolerances: {g.flatten()[worst]} vs "
            f"{r.flatten()[worst]}")
    else:
        g = got_data.contiguous().view(torch.float8_e4m3fn).double()
        r = ref_data.contiguous().view(torch.float8_e4m3fn).double()
        assert bool(((g - r).abs() <= _e4m3_step(r) * (1 + 1e-9)).all()), "fp8 value off"


@pytest.mark.parametrize("kv_block_size", [2, 64])
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 65, 128, 512, 4096])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matches_float64_reference(fmt, num_tokens, kv_block_size):
    case = make_case(fmt, num_tokens, kv_block_size, "cuda", seed=num_tokens,
                     boundary_every=None if num_tokens <= 2 else 3)
    cute_kernels.compress_c128(*case.args())
    torch.cuda.synchronize()
    _check(case, case.backing)
    first = case.backing.clone()
    case.backing.view(torch.uint8).fill_(0xA5)
    cute_kernels.compress_c128(*case.args())
    assert torch.equal(case.backing.view(torch.uint8), first.view(torch.uint8)), "determinism"


@pytest.mark.parametrize("boundary_from", [1000, 2150, 4064])
@pytest.mark.parametrize("fmt", ["v4_packed", "bf16"])
def test_boundaries_after_empty_chunks(fmt, boundary_from):
    """No boundary token in the first chunks (32 tokens each) of a cluster's tokens, and
    clusters with none at all: the issuing cursor walks past empty chunks to the first one
    that has a boundary token (on the H200's 30 clusters of 136-137 tokens, the one holding
    token ``boundary_from`` starts 1, 3 and 3 chunks before it)."""
    case = make_case(fmt, 4096, 2, "cuda", seed=boundary_from, boundary_from=boundary_from)
    assert bool(case.boundary.any()) and not bool(case.boundary[:boundary_from].any())
    cute_kernels.compress_c128(*case.args())
    torch.cuda.synchronize()
    _check(case, case.backing)


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
def test_norm_weight_dtypes(norm_dtype):
    case = make_case("v4_packed", 200, 2, "cuda", norm_dtype=norm_dtype)
    cute_kernels.compress_c128(*case.args())
    _check(case, case.backing)


def test_no_boundary_writes_nothing():
    case = make_case("v4_packed", 512, 2, "cuda", boundary_every=0)
    cute_kernels.compress_c128(*case.args())
    torch.cuda.synchronize()
    assert bool((case.backing.view(torch.uint8) == 0xA5).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_graph_replay(fmt):
    case = make_case(fmt, 300, 2, "cuda")
    cute_kernels.compress_c128(*case.args())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_kernels.compress_c128(*case.args())
    case.state_cache.normal_()  # new data, same addresses
    case.backing.view(torch.uint8).fill_(0xA5)
    graph.replay()
    torch.cuda.synchronize()
    _check(case, case.backing)


def test_torch_compile_fullgraph():
    case = make_case("v4_packed", 130, 2, "cuda")

    @torch.compile(fullgraph=True)
    def step(state, k_cache):
        cute_kernels.compress_c128(state * 1, *case.args(k_cache)[1:])

    step(case.state_cache, case.k_cache)
    torch.cuda.synchronize()
    _check(case, case.backing)


def test_persistent_grid_is_the_resident_cluster_count():
    """The driver's answer, bounded by the per-SM formula (clusters cannot span GPCs), cached;
    the grid never exceeds the token count."""
    from cute_kernels.arch import max_active_clusters
    from cute_kernels.compress_c128 import GRID_WAVES, CompressC128, _grid_clusters

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads = 32 * CompressC128.WARPS
    resident = max_active_clusters(0, CompressC128.CLUSTER, CompressC128.CTAS_PER_SM, threads)
    assert 1 <= resident <= CompressC128.CTAS_PER_SM * sms // CompressC128.CLUSTER
    assert max_active_clusters(0, CompressC128.CLUSTER, 1, threads) <= sms // 8
    device = torch.device("cuda", 0)
    assert _grid_clusters(device, 1 << 20) == GRID_WAVES * resident
    assert _grid_clusters(device, 3) == 3
