"""Kernel against the reference on the GPU: byte-exact over the whole cache backing."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.arch import sm_count
from cute_kernels.kv_rope_insert import KvRopeInsert
from cute_kernels.layouts import CacheFormat
from cute_kernels.testing import extreme_kv_rows
from cute_kernels.testing import kv_rope_insert_case as make_case

FORMATS = [f.value for f in CacheFormat]

pytestmark = pytest.mark.gpu


def _check_rounds(case, run) -> None:
    """Three rounds with fresh kv and shifted positions; round 2 skips every slot."""
    ref_backing, ref_cache = case.twin()
    for rnd in range(3):
        case.kv.normal_()
        case.positions.add_(1)
        kv_before = case.kv.clone()
        if rnd == 2:
            case.slot_mapping.fill_(-1)
        case.poison()
        ref_backing.view(torch.uint8).fill_(0xA5)
        reference.kv_rope_insert(*case.args(ref_cache))
        run()
        torch.cuda.synchronize()
        got = case.backing.view(torch.uint8)
        want = ref_backing.view(torch.uint8)
        mismatch = (got != want).nonzero()
        assert mismatch.numel() == 0, (
            f"round {rnd}: {mismatch.numel()} bytes differ, "
            f"first at {mismatch[:8].flatten().tolist()}"
        )
        assert torch.equal(case.kv, kv_before), "kv must not be modified"


# 48 is not a power of two (the multiply-shift of divisor_magic with its 64-bit division); 1, 32,
# 64 and 256 are (the division skipped)
@pytest.mark.parametrize("block_size", [1, 32, 48, 64, 256])
@pytest.mark.parametrize("num_slots", [1, 17, 1023, 1024, 4097, 65536])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_byte_exact(fmt, num_slots, block_size):
    case = make_case(fmt, num_slots, block_size, "cuda")
    _check_rounds(case, lambda: cute_kernels.kv_rope_insert(*case.args()))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_byte_exact_with_many_slots_per_warp(fmt):
    """Every warp strides over more than one 32-slot chunk of (slot, position) registers and
    wraps its ring many times; skipped rows carry positions far outside the cos/sin table,
    which the kernel must never read (an out-of-bounds read faults)."""
    warps = sm_count(torch.device("cuda")) * KvRopeInsert.CTAS_PER_SM * KvRopeInsert.WARPS_PER_CTA
    case = make_case(fmt, 33 * warps + 37, 64, "cuda", extra_rows=5)
    case.positions[4::5] = 1 << 40  # the rows whose slot is -1 (skip_every = 5)
    assert bool((case.slot_mapping[4::5] == -1).all())
    ref_backing, ref_cache = case.twin()
    reference.kv_rope_insert(*case.args(ref_cache))
    cute_kernels.kv_rope_insert(*case.args())
    torch.cuda.synchronize()
    assert torch.equal(case.backing.view(torch.uint8), ref_backing.view(torch.uint8))


@pytest.mark.parametrize("num_slots", [37, 70001])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_out_of_range_indices_write_nothing(fmt, num_slots):
    """Slots past the cache (into the guard page behind it, and one at 2^40) and positions
    outside the cos/sin table skip their rows: byte-exact with the reference, the guard page
    untouched, no fault."""
    case = make_case(fmt, num_slots, 48, "cuda", out_of_range=True)
    ref_backing, ref_cache = case.twin()
    reference.kv_rope_insert(*case.args(ref_cache))
    cute_kernels.kv_rope_insert(*case.args())
    torch.cuda.synchronize()
    assert torch.equal(case.backing.view(torch.uint8), ref_backing.view(torch.uint8))
    guard = case.backing.view(torch.uint8)[case.k_cache.shape[0] * case.k_cache.stride(0)
                                           * case.k_cache.element_size():]
    assert guard.numel() > 0 and bool((guard == 0xA5).all())


@pytest.mark.parametrize("num_slots", [1, 1024, 4097])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_graph_replay_with_mutated_inputs(fmt, num_slots):
    case = make_case(fmt, num_slots, 64, "cuda")
    cute_kernels.kv_rope_insert(*case.args())  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        cute_kernels.kv_rope_insert(*case.args())
    if case.fp8_scale is not None:
        case.fp8_scale.fill_(1.3)  # the scale is read on device at replay
    _check_rounds(case, graph.replay)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_torch_compile_fullgraph(fmt):
    case = make_case(fmt, 300, 64, "cuda")

    @torch.compile(fullgraph=True)
    def step(kv, k_cache, slots, positions, cos_sin, scale):
        cute_kernels.kv_rope_insert(kv * 1, k_cache, slots, positions, cos_sin,
                                    case.block_size, scale, case.kv_mxfp8)

    ref_backing, ref_cache = case.twin()
    reference.kv_rope_insert(*case.args(ref_cache))
    step(case.kv, case.k_cache, case.slot_mapping, case.positions, case.cos_sin_cache,
         case.fp8_scale)
    torch.cuda.synchronize()
    assert torch.equal(case.backing.view(torch.uint8), ref_backing.view(torch.uint8))


def test_one_compile_serves_every_token_count():
    cute_kernels.kv_rope_insert(*make_case("v4_packed", 5, 64, "cuda").args())  # warm
    before = cute_kernels.cache_stats()["compiles"]
    for num_slots in (1, 17, 1024, 262144):
        case = make_case("v4_packed", num_slots, 64, "cuda")
        cute_kernels.kv_rope_insert(*case.args())
    assert cute_kernels.cache_stats()["compiles"] == before


def test_no_slots_launches_nothing():
    case = make_case("bf16", 4, 64, "cuda")
    empty = case.slot_mapping[:0]
    cute_kernels.kv_rope_insert(case.kv, case.k_cache, empty, case.positions,
                                case.cos_sin_cache, 64)
    torch.cuda.synchronize()
    assert bool((case.backing.view(torch.uint8) == 0xA5).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_byte_exact_at_extreme_magnitudes(fmt):
    """Group maxima across the whole bf16 range (subnormal to 2^100, zero, below the 1e-4
    floor, on and beside the 1.75 x 2^k boundary of the exponent rule): the kernel's bf16-pair
    maxima and power-of-two scaling give the reference's codes and scale bytes."""
    case = make_case(fmt, 4000, 64, "cuda", skip_every=0)
    extreme_kv_rows(case.kv)
    ref_backing, ref_cache = case.twin()
    reference.kv_rope_insert(*case.args(ref_cache))
    cute_kernels.kv_rope_insert(*case.args())
    torch.cuda.synchronize()
    got, want = case.backing.view(torch.uint8), ref_backing.view(torch.uint8)
    mismatch = (got != want).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} bytes differ, first at {mismatch[:8]}"
