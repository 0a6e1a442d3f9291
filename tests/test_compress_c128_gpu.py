"""C128 compressor kernel against the float64 reference on the GPU, with the tolerance rules of
specs/compress_c128.md."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import cute_kernels
from cute_kernels.compress_c128 import CORE_ENV, CORES
from cute_kernels.compress_c128.interface import KERNELS
from cute_kernels.layouts import C128_FORMATS
from cute_kernels.testing import c128_mismatch
from cute_kernels.testing import compress_c128_case as make_case

FORMATS = [f.value for f in C128_FORMATS]

pytestmark = pytest.mark.gpu


def _check(case, got_backing: torch.Tensor) -> None:
    mismatch = c128_mismatch(case, got_backing)
    assert mismatch is None, mismatch


@pytest.fixture(params=CORES)
def core(request, monkeypatch):
    """Each test on each core, forced (either core serves every token count)."""
    monkeypatch.setenv(CORE_ENV, request.param)
    return request.param


@pytest.mark.parametrize("kv_block_size", [2, 64])
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 65, 128, 512, 4096])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matches_float64_reference(fmt, num_tokens, kv_block_size, core):
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
def test_boundaries_after_empty_chunks(fmt, boundary_from, core):
    """No boundary token in the first chunks (32 tokens each) of a cluster's tokens, and
    clusters with none at all: the issuing cursor walks past empty chunks to the first one
    that has a boundary token (on the H200's 30 clusters of 136-137 tokens, the one holding
    token ``boundary_from`` starts 1, 3 and 3 chunks before it)."""
    case = make_case(fmt, 4096, 2, "cuda", seed=boundary_from, boundary_from=boundary_from)
    assert bool(case.boundary.any()) and not bool(case.boundary[:boundary_from].any())
    cute_kernels.compress_c128(*case.args())
    torch.cuda.synchronize()
    _check(case, case.backing)


@pytest.mark.parametrize("num_tokens", [600, 9000])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_out_of_range_indices(fmt, num_tokens, core):
    """Boundary tokens whose request, window or record slot lies outside its tensor (a slot
    into the guard page behind the cache, one at 2^40) write nothing, page ids outside the
    state cache are read clamped into it: the records within the tolerance rules of the
    reference, every other byte (the guard page included) untouched, no fault."""
    case = make_case(fmt, num_tokens, 2, "cuda", seed=9, out_of_range=True)
    on_boundary = ((case.slot_mapping >= 0) & (case.kv_slot_mapping >= 0)
                   & ((case.positions + 1) % 128 == 0))
    assert int((on_boundary & ~case.boundary).sum()) >= 8
    cute_kernels.compress_c128(*case.args())
    torch.cuda.synchronize()
    _check(case, case.backing)


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
def test_norm_weight_dtypes(norm_dtype):
    case = make_case("v4_packed", 200, 2, "cuda", norm_dtype=norm_dtype)
    cute_kernels.compress_c128(*case.args())
    _check(case, case.backing)


def test_no_boundary_writes_nothing(core):
    case = make_case("v4_packed", 512, 2, "cuda", boundary_every=0)
    cute_kernels.compress_c128(*case.args())
    torch.cuda.synchronize()
    assert bool((case.backing.view(torch.uint8) == 0xA5).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_graph_replay(fmt, core):
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


@pytest.mark.parametrize("num_tokens", [8, 130])  # one of each core
def test_torch_compile_fullgraph(num_tokens):
    case = make_case("v4_packed", num_tokens, 2, "cuda")

    @torch.compile(fullgraph=True)
    def step(state, k_cache):
        cute_kernels.compress_c128(state * 1, *case.args(k_cache)[1:])

    step(case.state_cache, case.k_cache)
    torch.cuda.synchronize()
    _check(case, case.backing)


@pytest.mark.parametrize("num_tokens", [1, 65, 4096])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cores_write_the_same_bytes(fmt, num_tokens, monkeypatch):
    """Both cores pool, merge and sum in the same order: a record does not depend on which
    core the token count picked."""
    case = make_case(fmt, num_tokens, 2, "cuda", seed=num_tokens + 1,
                     boundary_every=None if num_tokens <= 2 else 3)
    written = []
    cute_kernels.compress_c128.forget_layouts()  # each call then asks for its compiled function
    with mock.patch.object(KERNELS, "get", wraps=KERNELS.get) as lookups:
        for core in CORES:
            monkeypatch.setenv(CORE_ENV, core)
            case.backing.view(torch.uint8).fill_(0xA5)
            cute_kernels.compress_c128(*case.args())
            torch.cuda.synchronize()
            written.append(case.backing.view(torch.uint8).clone())
    assert {call.args[0].core for call in lookups.call_args_list} == set(CORES)
    assert bool((written[0] != 0xA5).any())
    assert torch.equal(written[0], written[1])


def test_persistent_grid_is_the_resident_cluster_count():
    """The driver's answer, bounded by the per-SM formula (clusters cannot span GPCs), cached;
    the grid never exceeds the token count."""
    from cute_kernels.arch import max_active_clusters
    from cute_kernels.compress_c128 import CompressC128
    from cute_kernels.compress_c128.interface import GRID_WAVES, _grid_clusters

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads = 32 * CompressC128.WARPS
    resident = max_active_clusters(0, CompressC128.CLUSTER, CompressC128.CTAS_PER_SM, threads)
    assert 1 <= resident <= CompressC128.CTAS_PER_SM * sms // CompressC128.CLUSTER
    assert max_active_clusters(0, CompressC128.CLUSTER, 1, threads) <= sms // 8
    device = torch.device("cuda", 0)
    assert _grid_clusters(device, 1 << 20) == GRID_WAVES * resident
    assert _grid_clusters(device, 3) == 3
