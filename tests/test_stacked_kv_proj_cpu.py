"""Stacked KV projection on the CPU: the reference against a float64 computation with the same
three rounding points, its row rules, and every rejection of the layout check (on meta and CPU
tensors, one test each, LayoutError naming the argument)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from cute_kernels import LayoutError, check_stacked_kv_proj, stacked_kv_proj
from cute_kernels import reference as ref
from cute_kernels.layouts import STACKED_K_TILE
from cute_kernels.stacked_kv_proj.plan import (
    CLUSTER_MAX_SPLITS,
    PERSISTENT_MAX_HIDDEN,
    TILES,
    StackedLayout,
    StackedPlan,
    StackedVariant,
    choose_plan,
    choose_splits,
    choose_tile,
    formula_residency,
    schedule,
    swap_ring,
    tile_n,
    variants_for,
)
from cute_kernels.testing import POISON, ulp_distance
from cute_kernels.testing import compare_stacked as compare
from cute_kernels.testing import stacked_kv_proj_case as make_case

# -- the reference ------------------------------------------------------------------------------


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def float64_outputs(case) -> tuple[list, list, torch.Tensor]:
    """Per layer (K, V) [rows, n_kv, D] for the written rows: float64 math, bf16 rounding only
    at R1, R2 and R3."""
    rows, _ = case.written_rows()
    n_kv, d = case.k_caches[0].shape[1:]
    kv = n_kv * d
    half = d // 2
    x = case.ctx_hidden[rows].double()
    table = case.cos_sin_cache[case.positions[rows]].double()
    cos, sin = table[:, None, :half], table[:, None, half:]
    ks, vs = [], []
    for layer in range(case.num_layers):
        w = case.weight[layer * 2 * kv:(layer + 1) * 2 * kv].double()
        y = x @ w.t()
        if case.bias is not None:
            y = y + case.bias[layer * 2 * kv:(layer + 1) * 2 * kv].double()
        y = _bf16(y)  # R1
        k = y[:, :kv].reshape(-1, n_kv, d)
        rstd = 1.0 / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + case.eps)
        k = _bf16(k * rstd * case.k_norm_weight[layer].double())  # R2
        k1, k2 = k[..., :half], k[..., half:]
        ks.append(_bf16(torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1)))  # R3
        vs.append(y[:, kv:].reshape(-1, n_kv, d))
    return ks, vs, rows


REF_CASES = [
    dict(tokens=37),
    dict(tokens=64, bias=True, row_pad=8),
    dict(tokens=56, commit=True, num_layers=3, n_kv=1),
    dict(tokens=20, head_dim=64, n_kv=3, norm_dtype=torch.bfloat16),
    dict(tokens=9, head_dim=256, n_kv=1, num_layers=1, bias=True),
]


@pytest.mark.parametrize("params", REF_CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in
                                                                      p.items()))
def test_reference_matches_float64(params):
    case = make_case(hidden=512, **params)
    ref.stacked_kv_proj(*case.args())
    ks, vs, rows = float64_outputs(case)
    _, slots = case.written_rows()
    assert rows.numel() > 0
    for layer in range(case.num_layers):
        for got_c, want in ((case.k_caches[layer], ks[layer]), (case.v_caches[layer], vs[layer])):
            got = got_c[slots]
            want_bf = want.to(torch.bfloat16)
            d = ulp_distance(got, want_bf)
            assert (d <= 1).float().mean() >= 0.999, int(d.max())
            torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_v_is_the_rounded_projection():
    case = make_case(16, bias=True, skip_every=0)
    ref.stacked_kv_proj(*case.args())
    kv = case.k_caches[0].shape[1] * case.k_caches[0].shape[2]
    for layer in range(case.num_layers):
        lo = layer * 2 * kv + kv
        y = (case.ctx_hidden.float() @ case.weight[lo:lo + kv].float().t()
             + case.bias[lo:lo + kv].float()).to(torch.bfloat16)
        assert torch.equal(case.v_caches[layer][case.cache_loc].reshape(16, kv), y)


def test_k_heads_have_unit_rms_before_the_weight():
    """With a unit norm weight, each RoPE'd K head keeps RMS ~1 (rotation preserves norms)."""
    case = make_case(32, skip_every=0)
    case.k_norm_weight.fill_(1.0)
    ref.stacked_kv_proj(*case.args())
    k = case.k_caches[1][case.cache_loc].float()
    rms = k.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-2, atol=1e-2)


def _untouched(case) -> bool:
    """Every byte of ``case``'s caches outside its written rows still holds the poison (the
    comparison's reference side is the caches themselves: only its poison test is asked)."""
    return compare(case, case.k_caches, case.v_caches, assert_close=False).untouched_equal


def test_skipped_rows_stay_untouched():
    """Rows 2, 5, ..., 38 skip: the written rows hold the float64 first-principles values and
    every other byte keeps the poison."""
    case = make_case(40, skip_every=3)
    ref.stacked_kv_proj(*case.args())
    rows, slots = case.written_rows()
    assert rows.numel() == 40 - len(range(2, 40, 3))
    ks, vs, _ = float64_outputs(case)
    for layer in range(case.num_layers):
        for got_c, want in ((case.k_caches[layer], ks[layer]), (case.v_caches[layer], vs[layer])):
            torch.testing.assert_close(got_c[slots].double(), want, rtol=2e-2, atol=2e-2)
    assert _untouched(case)



def _planted_midpoint_case():
    """A case whose row 1, layer 0, K head 0 has one exact sum on a bf16 rounding midpoint
    (element 5: 1 + 2^-8, between 1 and 1 + 2^-7) and exact bf16 sums elsewhere, with a norm
    weight of 64 so that rounding element 5 the other way moves the output by far more than
    the 2e-2 tolerance."""
    case = make_case(4, hidden=256, num_layers=1, n_kv=1, head_dim=64, skip_every=0)
    case.ctx_hidden[1] = 0
    case.ctx_hidden[1, :2] = 1.0
    case.weight[:64, 1] = 0
    case.weight[5, :2] = torch.tensor([1.0, 2.0 ** -8])
    case.k_norm_weight[0] = 64.0
    return case


def _write_head(case, head_values) -> None:
    """Row 1's layer-0 K head of the case's own caches set to ``head_values`` (what a kernel
    would have written)."""
    _, slots = case.written_rows()
    case.k_caches[0][slots[1], 0] = head_values


def _head_after_r1(case, y):
    table = case.cos_sin_cache[case.positions[1]].float()
    return ref.k_norm_rope(y[None, None], case.k_norm_weight[0], case.eps,
                           table[None, None, :32], table[None, None, 32:])[0, 0]


def test_compare_attributes_an_r1_midpoint_flip_and_nothing_else():
    """The 2e-2 bound is checked against the reference; a K head outside it passes only when
    rounding near-midpoint R1 sums the other way reproduces it (testing.r1_flip_explains)."""
    case = _planted_midpoint_case()
    _, _, kc, vc = case.twin()
    ref.stacked_kv_proj(*case.args(kc, vc))
    ref.stacked_kv_proj(*case.args())
    y = (case.weight[:64].double() @ case.ctx_hidden[1].double()).to(torch.bfloat16)
    assert float(y[5]) == 1.0  # round half to even
    flipped = y.clone()
    flipped[5] = 1.0 + 2.0 ** -7
    _write_head(case, _head_after_r1(case, flipped))
    slot = case.written_rows()[1][1]
    assert float((case.k_caches[0][slot, 0].float() - kc[0][slot, 0].float()).abs().max()) > 0.1
    compare(case, kc, vc)  # explained: passes

    wrong = y.clone()
    wrong[6] = -y[6]  # element 6 is an exact bf16 sum: no rounding order can change it
    _write_head(case, _head_after_r1(case, wrong))
    with pytest.raises(AssertionError, match="not explained by an R1 rounding flip"):
        compare(case, kc, vc)


def test_commit_lens_select_rows_and_replace_cache_loc():
    case = make_case(56, commit=True, skip_every=0)
    width = case.cache_loc_2d.shape[1]
    ref.stacked_kv_proj(*case.args())
    assert bool((case.cache_loc == -1).all())  # cache_loc is ignored when cache_loc_2d is given
    for t in range(56):
        b, col = divmod(t, width)
        slot = int(case.cache_loc_2d[b, col])
        written = col < int(case.commit_lens[b])
        row_poison = bool((case.k_caches[0][slot].view(torch.uint8) == POISON).all())
        assert written != row_poison, (t, written)


def test_every_layer_uses_its_own_norm_weight():
    case = make_case(8, skip_every=0, num_layers=2)
    case.k_norm_weight[1] = case.k_norm_weight[0]
    ref.stacked_kv_proj(*case.args())
    k_same = [c[case.cache_loc].clone() for c in case.k_caches]
    case.k_norm_weight[1].mul_(2.0)
    ref.stacked_kv_proj(*case.args())
    assert torch.equal(case.k_caches[0][case.cache_loc], k_same[0])
    assert not torch.equal(case.k_caches[1][case.cache_loc], k_same[1])


# -- rejections ---------------------------------------------------------------------------------

DEVICES = ["meta", "cpu"]


def _meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _args(device, **overrides):
    case = make_case(16, hidden=128, commit=False)
    args = dict(
        ctx_hidden=case.ctx_hidden, weight=case.weight, bias=case.bias,
        k_norm_weight=case.k_norm_weight, eps=case.eps, positions=case.positions,
        cos_sin_cache=case.cos_sin_cache, cache_loc=case.cache_loc, k_caches=case.k_caches,
        v_caches=case.v_caches, cache_loc_2d=None, commit_lens=None,
    )
    if device == "meta":
        args = {k: ([_meta(c) for c in v] if isinstance(v, list) else _meta(v))
                for k, v in args.items()}
    for key, value in overrides.items():
        args[key] = value(args) if callable(value) else value
    return args


def _rejects(args, *fragments):
    """The LayoutError blames the argument ``fragments[0]`` and holds the other fragments."""
    with pytest.raises(LayoutError) as err:
        check_stacked_kv_proj(**args)
    msg = str(err.value)
    assert msg.startswith(f"{fragments[0]}: expected"), msg
    for fragment in fragments[1:]:
        assert fragment in msg, msg
    assert "got" in msg, msg


def _like(t, shape=None, dtype=None, stride=None):
    shape = t.shape if shape is None else shape
    dtype = t.dtype if dtype is None else dtype
    if stride is None:
        return torch.zeros(shape, dtype=dtype, device=t.device)
    return torch.empty_strided(shape, stride, dtype=dtype, device=t.device)


def _misaligned(t):
    """A view whose data pointer is 2 bytes off a 16-byte boundary (same shape)."""
    flat = torch.zeros(t.numel() + 8, dtype=t.dtype, device=t.device)
    return flat[1:1 + t.numel()].view(t.shape)


def _cache_list(args, name, fn):
    caches = list(args[name])
    caches[0] = fn(caches[0])
    return caches


def _with_2d(args, **over):
    t = args["ctx_hidden"].shape[0]
    dev = args["ctx_hidden"].device
    out = dict(cache_loc_2d=torch.zeros(2, t // 2, dtype=torch.int64, device=dev),
               commit_lens=torch.zeros(2, dtype=torch.int32, device=dev))
    out.update(over)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_accepts_supported_layouts(device):
    assert check_stacked_kv_proj(**_args(device)) is None
    args = _args(device)
    args.update(_with_2d(args))
    assert check_stacked_kv_proj(**args) is None
    assert check_stacked_kv_proj(**_args(device, bias=lambda a: _like(
        a["weight"], shape=(a["weight"].shape[0],)))) is None
    assert check_stacked_kv_proj(**_args(device, k_norm_weight=lambda a: _like(
        a["k_norm_weight"], dtype=torch.bfloat16))) is None


def _head_dim_96(a):
    return [_like(c, shape=(8, 2, 96)) for c in a["k_caches"]]


def _with(**over):
    """Overrides that replace cache_loc_2d / commit_lens together (``_with_2d``)."""
    return {"_2d": lambda a: _with_2d(a, **{k: v(a) for k, v in over.items()})}


REJECTIONS = {  # name -> (overrides, fragments of the message)
    "ctx_hidden_not_a_tensor": (dict(ctx_hidden=[1.0]), ("ctx_hidden", "torch.Tensor")),
    "ctx_hidden_dtype": (dict(ctx_hidden=lambda a: _like(a["ctx_hidden"], dtype=torch.float16)),
                         ("ctx_hidden", "bfloat16")),
    "ctx_hidden_rank": (dict(ctx_hidden=lambda a: _like(a["ctx_hidden"], shape=(16, 2, 64))),
                        ("ctx_hidden", "2-D")),
    "hidden_not_a_tile_multiple": (dict(ctx_hidden=lambda a: _like(a["ctx_hidden"],
                                                                   shape=(16, 96))),
                                   ("ctx_hidden", "multiple of 64")),
    "ctx_hidden_inner_stride": (dict(ctx_hidden=lambda a: _like(a["ctx_hidden"],
                                                                stride=(1, 16))),
                                ("ctx_hidden", "stride 1")),
    "ctx_hidden_row_stride_alignment": (dict(ctx_hidden=lambda a: _like(a["ctx_hidden"],
                                                                        stride=(132, 1))),
                                        ("ctx_hidden", "16 bytes")),
    "weight_dtype_quantised": (dict(weight=lambda a: _like(a["weight"],
                                                           dtype=torch.float8_e4m3fn)),
                               ("weight", "bfloat16")),
    "weight_int8": (dict(weight=lambda a: _like(a["weight"], dtype=torch.int8)),
                    ("weight", "bfloat16")),
    "weight_rows": (dict(weight=lambda a: _like(a["weight"], shape=(512, 128))),
                    ("weight", "L*2*n_kv*D")),
    "weight_hidden": (dict(weight=lambda a: _like(a["weight"], shape=(1024, 192))),
                      ("weight", "shape")),
    "weight_inner_stride": (dict(weight=lambda a: _like(a["weight"], stride=(1, 1024))),
                            ("weight", "stride 1")),
    "head_dim": (dict(k_caches=_head_dim_96), ("k_caches[0]", "head dim")),
    "bias_dtype": (dict(bias=lambda a: _like(a["weight"], shape=(1024,), dtype=torch.float32)),
                   ("bias", "bfloat16")),
    "bias_shape": (dict(bias=lambda a: _like(a["weight"], shape=(512,))), ("bias", "1024")),
    "k_norm_weight_dtype": (dict(k_norm_weight=lambda a: _like(a["k_norm_weight"],
                                                               dtype=torch.float16)),
                            ("k_norm_weight", "float32")),
    "k_norm_weight_rank": (dict(k_norm_weight=lambda a: _like(a["k_norm_weight"],
                                                              shape=(128,))),
                           ("k_norm_weight", "2-D")),
    "k_norm_weight_shape": (dict(k_norm_weight=lambda a: _like(a["k_norm_weight"],
                                                               shape=(3, 128))),
                            ("k_norm_weight", "[L, D]")),
    "eps_negative": (dict(eps=-1.0), ("eps", "non-negative")),
    "eps_bool": (dict(eps=True), ("eps",)),
    "eps_string": (dict(eps="1e-6"), ("eps",)),
    "eps_overflows_a_float": (dict(eps=10**400), ("eps", "finite")),
    "eps_beyond_fp32": (dict(eps=1e39), ("eps", "fp32")),
    "positions_dtype": (dict(positions=lambda a: _like(a["positions"], dtype=torch.int32)),
                        ("positions", "int64")),
    "positions_length": (dict(positions=lambda a: _like(a["positions"], shape=(15,))),
                         ("positions", "16 entries")),
    "positions_rank": (dict(positions=lambda a: _like(a["positions"], shape=(16, 1))),
                       ("positions", "1-D")),
    "positions_0d": (dict(positions=lambda a: _like(a["positions"], shape=())),
                     ("positions", "1-D")),
    "cache_loc_dtype": (dict(cache_loc=lambda a: _like(a["cache_loc"], dtype=torch.int32)),
                        ("cache_loc", "int64")),
    "cache_loc_length": (dict(cache_loc=lambda a: _like(a["cache_loc"], shape=(17,))),
                         ("cache_loc", "16 entries")),
    "cache_loc_none": (dict(cache_loc=None), ("cache_loc", "torch.Tensor")),
    "cos_sin_dtype": (dict(cos_sin_cache=lambda a: _like(a["cos_sin_cache"],
                                                         dtype=torch.bfloat16)),
                      ("cos_sin_cache", "float32")),
    "cos_sin_width": (dict(cos_sin_cache=lambda a: _like(a["cos_sin_cache"],
                                                         shape=(4096, 64))),
                      ("cos_sin_cache", "D = 128")),
    "cos_sin_not_contiguous": (dict(cos_sin_cache=lambda a: _like(a["cos_sin_cache"],
                                                                  stride=(1, 4096))),
                               ("cos_sin_cache", "contiguous")),
    "cache_lists_differ_in_length": (dict(v_caches=lambda a: a["v_caches"][:1]),
                                     ("v_caches", "2 tensors")),
    "caches_not_a_list": (dict(k_caches=lambda a: a["k_caches"][0]), ("k_caches", "list")),
    "caches_empty": (dict(k_caches=[]), ("k_caches", "non-empty")),
    "cache_dtype": (dict(k_caches=lambda a: _cache_list(
        a, "k_caches", lambda c: _like(c, dtype=torch.float16))), ("k_caches[0]", "bfloat16")),
    "cache_rank": (dict(v_caches=lambda a: _cache_list(
        a, "v_caches", lambda c: _like(c, shape=(8, 256)))), ("v_caches[0]", "3-D")),
    "v_cache_shape": (dict(v_caches=lambda a: _cache_list(
        a, "v_caches", lambda c: _like(c, shape=(8, 1, 128)))), ("v_caches[0]", "[slots, 2")),
    "cache_head_stride": (dict(k_caches=lambda a: _cache_list(
        a, "k_caches", lambda c: _like(c, shape=(8, 2, 128), stride=(512, 256, 1)))),
        ("k_caches[0]", "strides")),
    "cache_row_stride_alignment": (dict(k_caches=lambda a: _cache_list(
        a, "k_caches", lambda c: _like(c, shape=(8, 2, 128), stride=(260, 128, 1)))),
        ("k_caches[0]", "16 bytes")),
    "cache_rows_overlap": (dict(k_caches=lambda a: _cache_list(
        a, "k_caches", lambda c: _like(c, shape=(8, 2, 128), stride=(128, 128, 1)))),
        ("k_caches[0]", "overlap")),
    "cache_device": (dict(k_caches=lambda a: _cache_list(
        a, "k_caches", lambda c: torch.empty(c.shape, dtype=c.dtype, device=_other(a)))),
        ("k_caches[0]", "device")),
    "commit_lens_without_cache_loc_2d": (dict(commit_lens=lambda a: _with_2d(a)["commit_lens"]),
                                         ("cache_loc_2d",)),
    "cache_loc_2d_without_commit_lens": (dict(cache_loc_2d=lambda a: _with_2d(a)[
        "cache_loc_2d"]), ("commit_lens",)),
    "cache_loc_2d_size": (_with(cache_loc_2d=lambda a: torch.zeros(
        2, 7, dtype=torch.int64, device=a["ctx_hidden"].device)), ("cache_loc_2d", "bs*W")),
    "cache_loc_2d_dtype": (_with(cache_loc_2d=lambda a: torch.zeros(
        2, 8, dtype=torch.int32, device=a["ctx_hidden"].device)), ("cache_loc_2d", "int64")),
    "commit_lens_dtype": (_with(commit_lens=lambda a: torch.zeros(
        2, dtype=torch.int64, device=a["ctx_hidden"].device)), ("commit_lens", "int32")),
    "commit_lens_length": (_with(commit_lens=lambda a: torch.zeros(
        3, dtype=torch.int32, device=a["ctx_hidden"].device)), ("commit_lens", "2 entries")),
    "index_tensor_device": (dict(positions=lambda a: torch.zeros(16, dtype=torch.int64,
                                                                 device=_other(a))),
                            ("positions", "device")),
}


def _other(args) -> str:
    """A device other than the arguments' (meta <-> cpu)."""
    return "cpu" if args["ctx_hidden"].is_meta else "meta"


def _apply(args, overrides):
    for key, value in overrides.items():
        value = value(args) if callable(value) else value
        if key == "_2d":
            args.update(value)
        else:
            args[key] = value
    return args


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(REJECTIONS))
def test_rejection(device, name):
    overrides, fragments = REJECTIONS[name]
    _rejects(_apply(_args(device), overrides), *fragments)


@pytest.mark.parametrize("arg", ["ctx_hidden", "v_caches"])
def test_misaligned_base(arg):
    """Meta tensors have no address: CPU only."""
    args = _args("cpu")
    if arg == "v_caches":
        args["v_caches"] = _cache_list(args, "v_caches", _misaligned)
    else:
        args[arg] = _misaligned(args[arg])
    _rejects(args, f"{arg}[0]" if arg == "v_caches" else arg, "aligned to 16")


def test_kv_of_several_small_heads_is_accepted():
    """D = 64 with 3 heads: kv = 192 is not a multiple of the 128-column tile, but of D, so the
    tile falls back to 64 columns."""
    args = _args("meta")
    caches = [_like(c, shape=(8, 3, 64)) for c in args["k_caches"]]
    ok = dict(args, k_caches=caches, v_caches=[c.clone() for c in caches],
              weight=_like(args["weight"], shape=(2 * 2 * 192, 128)),
              k_norm_weight=_like(args["k_norm_weight"], shape=(2, 64)),
              cos_sin_cache=_like(args["cos_sin_cache"], shape=(64, 64)))
    assert check_stacked_kv_proj(**ok) is None


OVERRIDE_REJECTIONS = {  # name -> (environment, fragments)
    "wgmma_on_sm_100a": (dict(CUTE_KERNELS_ARCH="sm_100a", CUTE_KERNELS_STACKED_IMPL="wgmma"),
                         ("CUTE_KERNELS_STACKED_IMPL", "sm_100a")),
    "unknown_tile": (dict(CUTE_KERNELS_ARCH="sm_90a", CUTE_KERNELS_STACKED_TILE="m256"),
                     ("CUTE_KERNELS_STACKED_TILE", "m128w")),
    "wide_tile_needs_wgmma": (dict(CUTE_KERNELS_ARCH="sm_100a",
                                   CUTE_KERNELS_STACKED_TILE="m128w"),
                              ("CUTE_KERNELS_STACKED_TILE", "mma core")),
    "unsupported_arch": (dict(CUTE_KERNELS_ARCH="sm_80"), ("arch", "sm_90a")),
    "unknown_schedule": (dict(CUTE_KERNELS_ARCH="sm_90a", CUTE_KERNELS_STACKED_SCHEDULE="sk"),
                         ("CUTE_KERNELS_STACKED_SCHEDULE", "streamk")),
    "ctas_not_a_number": (dict(CUTE_KERNELS_ARCH="sm_90a", CUTE_KERNELS_STACKED_CTAS="many"),
                          ("CUTE_KERNELS_STACKED_CTAS", "positive integer")),
    "ctas_zero": (dict(CUTE_KERNELS_ARCH="sm_90a", CUTE_KERNELS_STACKED_CTAS="0"),
                  ("CUTE_KERNELS_STACKED_CTAS", "positive integer")),
    "splits_not_a_number": (dict(CUTE_KERNELS_ARCH="sm_90a", CUTE_KERNELS_STACKED_SPLITS="x2"),
                            ("CUTE_KERNELS_STACKED_SPLITS", "positive integer")),
    "swap_tile_needs_mma": (dict(CUTE_KERNELS_ARCH="sm_90a", CUTE_KERNELS_STACKED_IMPL="wgmma",
                                 CUTE_KERNELS_STACKED_TILE="swap16"),
                            ("CUTE_KERNELS_STACKED_TILE", "wgmma core")),
    "split_head_needs_wgmma": (dict(CUTE_KERNELS_ARCH="sm_100a",
                                    CUTE_KERNELS_STACKED_TILE="m64h"),
                               ("CUTE_KERNELS_STACKED_TILE", "mma core")),
    "split_head_is_data_parallel": (dict(CUTE_KERNELS_ARCH="sm_90a",
                                         CUTE_KERNELS_STACKED_TILE="m64h",
                                         CUTE_KERNELS_STACKED_SCHEDULE="streamk"),
                                    ("CUTE_KERNELS_STACKED_SCHEDULE", "dp")),
    "swapped_wgmma_needs_wgmma": (dict(CUTE_KERNELS_ARCH="sm_100a",
                                       CUTE_KERNELS_STACKED_TILE="sw80"),
                                  ("CUTE_KERNELS_STACKED_TILE", "mma core", "'sw80'")),
    "swapped_wgmma_is_data_parallel": (dict(CUTE_KERNELS_ARCH="sm_90a",
                                            CUTE_KERNELS_STACKED_TILE="sw80",
                                            CUTE_KERNELS_STACKED_SCHEDULE="streamk"),
                                       ("CUTE_KERNELS_STACKED_SCHEDULE", "dp")),
    "swapped_wgmma_split_at_most_a_cluster": (dict(CUTE_KERNELS_ARCH="sm_90a",
                                                   CUTE_KERNELS_STACKED_TILE="sw32",
                                                   CUTE_KERNELS_STACKED_SPLITS="9"),
                                              ("CUTE_KERNELS_STACKED_SPLITS", "at most 8",
                                               "sw32", "'9'")),
    "swapped_wgmma_split_in_its_cluster": (dict(CUTE_KERNELS_ARCH="sm_90a",
                                                CUTE_KERNELS_STACKED_TILE="sw32",
                                                CUTE_KERNELS_STACKED_SPLITS="4",
                                                CUTE_KERNELS_STACKED_HANDOVER="workspace"),
                                           ("CUTE_KERNELS_STACKED_HANDOVER", "cluster",
                                            "'workspace'")),
    "swapped_wgmma_split_tiles": (dict(CUTE_KERNELS_ARCH="sm_90a",
                                       CUTE_KERNELS_STACKED_TILE="sw48",
                                       CUTE_KERNELS_STACKED_SPLITS="2"),
                                  ("CUTE_KERNELS_STACKED_TILE", "one of sw32 with",
                                   "'sw48'")),
    # no arch on meta / CPU tensors: a value that no arch accepts is still rejected
    "unknown_impl_without_arch": (dict(CUTE_KERNELS_STACKED_IMPL="bogus"),
                                  ("CUTE_KERNELS_STACKED_IMPL", "wgmma", "'bogus'")),
    "unknown_tile_without_arch": (dict(CUTE_KERNELS_STACKED_TILE="m256"),
                                  ("CUTE_KERNELS_STACKED_TILE", "m128w", "'m256'")),
    "unknown_schedule_without_arch": (dict(CUTE_KERNELS_STACKED_SCHEDULE="sk"),
                                      ("CUTE_KERNELS_STACKED_SCHEDULE", "streamk")),
    "bad_handover_without_arch": (dict(CUTE_KERNELS_STACKED_HANDOVER="dsmem"),
                                  ("CUTE_KERNELS_STACKED_HANDOVER", "workspace")),
    "split_head_is_data_parallel_without_arch": (dict(CUTE_KERNELS_STACKED_TILE="m64h",
                                                      CUTE_KERNELS_STACKED_SCHEDULE="streamk"),
                                                 ("CUTE_KERNELS_STACKED_SCHEDULE", "dp")),
    "swapped_wgmma_split_at_most_a_cluster_without_arch": (
        dict(CUTE_KERNELS_STACKED_TILE="sw32", CUTE_KERNELS_STACKED_SPLITS="12"),
        ("CUTE_KERNELS_STACKED_SPLITS", "at most 8", "'12'")),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OVERRIDE_REJECTIONS))
def test_override_rejection(device, name, monkeypatch):
    env, fragments = OVERRIDE_REJECTIONS[name]
    monkeypatch.delenv("CUTE_KERNELS_ARCH", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _rejects(_args(device), *fragments)


@pytest.mark.parametrize("device", DEVICES)
def test_swapped_wgmma_tile_rejects_256_wide_heads(device, monkeypatch):
    """A swapped wgmma tile holds at most 128 weight rows: forced on D = 256 it is refused by
    name before anything compiles, with and without an arch."""
    case = make_case(9, hidden=128, num_layers=1, n_kv=1, head_dim=256)
    args = dict(ctx_hidden=case.ctx_hidden, weight=case.weight, bias=None,
                k_norm_weight=case.k_norm_weight, eps=case.eps, positions=case.positions,
                cos_sin_cache=case.cos_sin_cache, cache_loc=case.cache_loc,
                k_caches=case.k_caches, v_caches=case.v_caches)
    if device == "meta":
        args = {k: ([_meta(c) for c in v] if isinstance(v, list) else _meta(v))
                for k, v in args.items()}
    assert check_stacked_kv_proj(**args) is None
    monkeypatch.setenv("CUTE_KERNELS_STACKED_TILE", "sw64")
    _rejects(args, "CUTE_KERNELS_STACKED_TILE", "128 weight rows", "D = 256", "'sw64'")
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    _rejects(args, "CUTE_KERNELS_STACKED_TILE", "'sw64'")


@pytest.mark.parametrize(("tokens", "impl", "sms", "tile"), [
    (1, "wgmma", 132, "m64"), (64, "wgmma", 132, "m64"),
    (65, "wgmma", 132, "sw80"),  # one wave of 80-token tiles against one of m128
    # (H200, cold us, 2026-12-04) one wave of 120 sw96w tiles 41.2 against three of m64 49.0
    # and two of sw96; two of sw96w 79.4 against sw192's two 84.1 and sw128's three 81.2; four
    # of sw80w 140.7 against five of sw128 142.1 (a tie); 5 of sw256 243.7 against sw128w 244.0;
    # the persistent sw128p's 5 tiles a CTA 128.2 against sw80w's four waves 142.7, its 39 at
    # T = 8192 935.3 against 951.9 for sw256
    (256, "wgmma", 132, "sw96w"), (512, "wgmma", 132, "sw96w"), (1024, "wgmma", 132, "sw128p"),
    (2048, "wgmma", 132, "sw256"), (8192, "wgmma", 132, "sw128p"),
    (1024, "wgmma", 114, "sw256"),  # H100 PCIe: 640 m128 tiles are 6 waves, 320 sw256 3
    (64, "mma", 132, "m64"), (8192, "mma", 132, "m128"),  # the mma core has no wide tile
])
def test_tile_choice(tokens, impl, sms, tile, monkeypatch):
    """The drafter layout (L 5, n_kv 8, D 128: 80 column tiles of 128)."""
    monkeypatch.delenv("CUTE_KERNELS_STACKED_TILE", raising=False)
    assert choose_tile(tokens, impl, 5, 8, 128, sms) == tile


def test_persistent_tile_only_up_to_its_hidden_size(monkeypatch):
    """H 8192 measured slower on sw128p: the plan keeps the one-tile-per-CTA tiles there."""
    monkeypatch.delenv("CUTE_KERNELS_STACKED_TILE", raising=False)
    assert choose_tile(1024, "wgmma", 5, 8, 128, 132, hidden=PERSISTENT_MAX_HIDDEN) == "sw128p"
    assert choose_tile(1024, "wgmma", 5, 8, 128, 132,
                       hidden=2 * PERSISTENT_MAX_HIDDEN) == "sw80w"


@pytest.mark.parametrize(("n_kv", "head_dim", "has_bias"),
                         [(1, 64, False), (2, 64, True), (1, 128, False), (8, 128, True)])
def test_persistent_core_fits_an_sm(n_kv, head_dim, has_bias):
    """sw128p's static split of an SM: the setmaxnreg counts of its warpgroups within the 64 K
    registers, every consumer warpgroup's count at most 232, the ring (at least 4 stages)
    beside the staged fp32 tile within the SMEM budget, and the epilogue's passes covering
    every row of the tile at most 4 rows a thread a pass."""
    from cutlass import Float32

    from cute_kernels.stacked_kv_proj import wgmma_swap_persistent as persistent
    from cute_kernels.stacked_kv_proj.wgmma import PRODUCER_REGS, WGMMA_SMEM_BUDGET

    core = persistent.StackedKvProjWgmmaSwapPersistent(5, n_kv, head_dim, has_bias, False,
                                                       Float32, TILES["sw128p"])
    consumers = core.consumer_warpgroups
    assert consumers == min(n_kv * head_dim, 128) // 64
    assert core.threads == 128 * (consumers + 2)
    epilogue_regs = persistent.EPILOGUE_REGS if consumers == 2 else 65536 // core.threads
    assert 128 * (PRODUCER_REGS + consumers * core.consumer_regs + epilogue_regs) <= 65536
    assert core.consumer_regs <= persistent.MAX_CONSUMER_REGS and core.consumer_regs % 8 == 0
    ring = core.stages * (core.bm + core.bn) * core.bk * 2
    assert core.stages >= 4 and ring + 4 * core.staged_floats <= WGMMA_SMEM_BUDGET
    assert core.rows_per_thread <= persistent.EPILOGUE_ROWS_PER_PASS
    assert core.row_step * core.rows_per_thread >= core.bm
    assert core.epilogue_threads == 128 * core.epilogue_passes


def test_tile_choice_counts_the_layouts_tiles(monkeypatch):
    """L 2, n_kv 2: 8 column tiles, so 1024 tokens of 64-row tiles still fit in one wave."""
    monkeypatch.delenv("CUTE_KERNELS_STACKED_TILE", raising=False)
    assert choose_tile(1024, "wgmma", 2, 2, 128, 132) == "m64"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_layout_on_meta_with_arch_override(arch, monkeypatch):
    """Validation finds the layout; the plan (core, tile, schedule) is chosen at the launch,
    from T, H and the resident CTA count of the GPU the tensors are on."""
    monkeypatch.setenv("CUTE_KERNELS_ARCH", arch)
    layout = stacked_kv_proj.validate(*_args("meta").values())
    assert layout == StackedLayout(2, 2, 128, False, False, "float32", arch)
    # T <= 16 on either arch: the swapped tile on the mma core, 8 tiles split 8 ways, each
    # tile's splits a cluster (9 x 8 rings of 108 KiB would hold the 8 MiB in flight; a
    # cluster holds at most 8)
    assert choose_plan(layout, 16, 4096, 132) == StackedPlan(
        StackedVariant("mma", "swap16", cluster=True), False, 64, 8, 8)
    # T = 17: on sm_90a one token tile of sw32 (8 weight tiles split 8 ways in clusters); on
    # the mma core two swap16 token tiles on the same 8 weight tiles (the second reads the
    # weight from L2), 8 splits on one CTA per SM: clusters
    expected = (StackedPlan(StackedVariant("wgmma", "sw32", cluster=True), False, 64, 8, 8)
                if arch == "sm_90a"
                else StackedPlan(StackedVariant("mma", "swap16", cluster=True), False, 128, 16,
                                 8))
    assert choose_plan(layout, 17, 4096, 132) == expected
    # T = 256: 128 swapped tiles fit only 2 splits (est. 18.8 us); on sm_90a the wgmma core's
    # 64 split-head tiles (one wave, 32 clusters) are cheaper, the mma core has no other tile
    # that fits
    expected = (StackedPlan(StackedVariant("wgmma", "m64h"), False, 64, 64) if arch == "sm_90a"
                else StackedPlan(StackedVariant("mma", "swap16"), False, 256, 128, 2))
    assert choose_plan(layout, 256, 4096, 132) == expected
    # T = 257: past the swapped tile's range; 80 split-head tiles fit one wave on sm_90a
    expected = (StackedPlan(StackedVariant("wgmma", "m64h"), False, 80, 80) if arch == "sm_90a"
                else StackedPlan(StackedVariant("mma", "m64"), False, 40, 40))
    assert choose_plan(layout, 257, 4096, 132) == expected


def test_stream_k_where_the_swapped_tile_does_not_fit(monkeypatch):
    """H 8192, L 6, n_kv 8: 96 weight tiles of 2 MiB; at T = 64 the 384 swapped tiles do not
    fit at once, and the wgmma core's 96 data-parallel tiles are long: stream-K."""
    for name in ("CUTE_KERNELS_STACKED_IMPL", "CUTE_KERNELS_STACKED_TILE",
                 "CUTE_KERNELS_STACKED_SCHEDULE", "CUTE_KERNELS_STACKED_SPLITS"):
        monkeypatch.delenv(name, raising=False)
    layout = StackedLayout(6, 8, 128, False, False, "float32", "sm_90a")
    assert choose_plan(layout, 64, 8192, 132) == StackedPlan(StackedVariant("wgmma", "m64"),
                                                             True, 132, 0)


# (layout name, L, n_kv, D, H, T, the planned tile, splits): the choices the cost model makes
# on the layouts of the "Measured plan choice" table of specs/stacked_kv_proj.md (cold us,
# H200), each the faster of the measured plans there (the split-head cells: its same-run A/B
# against the plan before, 22:45 UTC)
COST_MODEL_CHOICES = [
    ("tp1", 5, 8, 128, 4096, 16, "swap16", 1),  # 28.2 us
    ("tp1", 5, 8, 128, 4096, 64, "m64", 1),  # 35.0 against 52.8 (320 swapped tiles)
    ("tp2", 5, 4, 128, 4096, 16, "swap16", 2),  # 18.9
    ("tp8", 5, 1, 128, 4096, 256, "m64h", 1),  # 15.9 against m64's 18.2
    ("1layer", 1, 8, 128, 4096, 128, "m64h", 1),  # 16.0 against swap16's 20.3
    ("d256", 2, 1, 256, 5120, 256, "m64h", 1),  # 20.9 against swap16's 23.6
    ("d64", 6, 4, 64, 2048, 16, "swap16", 3),  # 11.7 against m64h's 13.3
    ("d64", 6, 4, 64, 2048, 64, "m64h", 1),  # 11.5 against m64's 13.6
    # the swapped wgmma tiles (H200, 2026-12-02 13:30 UTC, cold us, each tile forced; the
    # wide ones 2026-12-04 16:00 UTC)
    ("tp8", 5, 1, 128, 4096, 1024, "sw80", 1),  # 130 CTAs: 22.7 against m128's 30.2
    ("tp8", 5, 1, 128, 4096, 2048, "sw160", 1),  # 36.9 against m64's 51.2
    ("tp4", 5, 2, 128, 4096, 1024, "sw80w", 1),  # 130 CTAs: 35.9 against sw192's 41.3
    ("tp2", 5, 4, 128, 4096, 1024, "sw80w", 1),  # 2 waves: 74.1 against sw128's 3, 79.3
    ("tp1", 5, 8, 128, 4096, 256, "sw96w", 1),  # 120 CTAs: 41.2 against m64's 48.7
    # the split-head tile only where m64 fills at most a third of the SMs (2026-12-04)
    ("1layer", 1, 8, 128, 4096, 256, "sw32", 1),  # 18.6 against m64h's 19.1-20.2
    ("tp4", 5, 2, 128, 4096, 144, "sw32", 1),  # 18.2 against m64h's 23.7
    ("tp2", 5, 4, 128, 4096, 256, "sw96", 1),  # 24.8 against m128's 30.2
    ("1layer", 1, 8, 128, 4096, 1024, "sw128", 1),  # 30.9 against m128's 32.1
    ("d64", 3, 4, 64, 4096, 1024, "sw96", 1),  # 24.4 against m128's 29.1
    ("d256", 2, 1, 256, 5120, 1024, "m64h", 1),  # no swapped wgmma tile holds 256 rows
    # the split swapped wgmma tile, on at most 80 CTAs (H200, 2026-12-02 20:00 UTC, cold us,
    # against the plan before it)
    ("tp8", 5, 1, 128, 4096, 64, "sw32", 4),  # 13.1 against swap16's 14.3 (6 splits)
    ("1layer", 1, 8, 128, 4096, 64, "m64h", 1),  # 2 splits: 14.7 / 14.8 against 15.3 / 15.2
    ("tp4", 5, 2, 128, 4096, 64, "m64h", 1),  # 2 splits: 15.4 / 16.7 against 15.6
    ("d64", 3, 4, 64, 4096, 64, "sw32", 3),  # 13.3 against m64h's 14.6
    ("small", 1, 1, 128, 2048, 256, "sw32", 5),  # 16 tiles: 6 / 4 splits 9.7 / 10.1, m64h 10.8
    ("tp8", 5, 1, 128, 4096, 16, "swap16", 8),  # T <= 16: the mma core's split, 10.4 / 11.3
    # from T = 17, where swap16 needs a second token tile (H200, 2026-12-05 07:43 UTC, cold us,
    # against the plan before): sw32 split, or one CTA a tile where fewer than 3 splits fit
    ("tp8", 5, 1, 128, 4096, 17, "sw32", 8),  # 11.2 against swap16's 12.0
    ("tp4", 5, 2, 128, 4096, 32, "sw32", 4),  # 14.8 against swap16's 15.1
    ("1layer", 1, 8, 128, 4096, 17, "sw32", 5),  # 4 / 6 splits 13.0 / 13.0 against 13.8
    ("tp2", 5, 4, 128, 4096, 32, "sw32", 1),  # 40 tiles: 18.9 against 2 splits' 20.7
    ("tp1", 5, 8, 128, 4096, 32, "sw32", 1),  # 80 tiles: 30.6 against swap16's 33.1
    ("tp2", 5, 4, 128, 4096, 64, "sw32", 1),  # 80 tiles: 19.0 against m64h's 19.9
    ("tp4", 5, 2, 128, 4096, 48, "swap16", 4),  # 2 token tiles: 15.9; sw32 1 / 2: 17.8 / 16.6
    ("tp1", 5, 8, 128, 4096, 48, "m64", 1),  # 160 sw32 tiles: 37.2 against 32.5
    # ... but not on 32 CTAs or fewer up to four swap16 token tiles (H200 2026-12-05 17:12
    # UTC and 2026-12-06 02:57 UTC)
    ("small", 1, 1, 128, 2048, 17, "swap16", 8),  # 32 CTAs: 6.8 against sw32's 16, 7.6
    ("small", 1, 1, 128, 2048, 32, "swap16", 8),  # 6.9 against 7.9
    ("small", 1, 1, 128, 2048, 48, "swap16", 8),  # 48 CTAs: 7.14 against sw32's 32, 8.16
    ("small", 1, 1, 128, 2048, 64, "swap16", 8),  # 64 CTAs: 7.22 against 8.18
    ("1layer-tp4", 1, 2, 128, 4096, 32, "swap16", 8),  # 4 weight tiles: 64 CTAs 8.96 vs 9.50
    ("small", 1, 1, 128, 2048, 65, "sw32", 8),  # from five swap16 token tiles: sw32
]


@pytest.mark.parametrize(("name", "layers", "n_kv", "head_dim", "hidden", "tokens", "tile",
                          "splits"), COST_MODEL_CHOICES)
def test_cost_model_choice(name, layers, n_kv, head_dim, hidden, tokens, tile, splits,
                           monkeypatch):
    for env in ("CUTE_KERNELS_STACKED_IMPL", "CUTE_KERNELS_STACKED_TILE",
                "CUTE_KERNELS_STACKED_SCHEDULE", "CUTE_KERNELS_STACKED_SPLITS"):
        monkeypatch.delenv(env, raising=False)
    layout = StackedLayout(layers, n_kv, head_dim, False, False, "float32", "sm_90a")
    plan = choose_plan(layout, tokens, hidden, 132)
    assert (plan.variant.tile, plan.splits) == (tile, splits)


def test_an_override_leaves_the_swapped_tile_out(monkeypatch):
    """A forced core or schedule plans as asked (TP 8, T = 64: the swapped tile otherwise)."""
    layout = StackedLayout(5, 1, 128, False, False, "float32", "sm_90a")
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SCHEDULE", "dp")
    assert choose_plan(layout, 64, 4096, 132) == StackedPlan(StackedVariant("wgmma", "m64h"),
                                                             False, 20, 20)
    monkeypatch.delenv("CUTE_KERNELS_STACKED_SCHEDULE")
    monkeypatch.setenv("CUTE_KERNELS_STACKED_TILE", "swap16")  # forced: even past one wave
    assert choose_plan(layout, 1024, 4096, 132).grid == 640


@pytest.mark.parametrize(("tiles", "k_tiles", "ctas", "stream_k", "expected"), [
    (80, 64, 132, True, (132, 0)),  # fewer tiles than CTAs: all stream-K
    (10, 64, 132, True, (132, 0)),  # TP 8: each tile split ~13 ways
    (2, 2, 132, True, (4, 0)),  # fewer k-iterations than CTAs: one CTA per k-tile
    (2, 64, 132, True, (30, 0)),  # at most 16 CTAs meet a tile (15 ranges each)
    (640, 64, 132, True, (132, 396)),  # 4.85 waves: 3 data-parallel, 1.85 stream-K
    (200, 64, 132, True, (132, 0)),  # 1.5 waves: all stream-K
    (264, 64, 132, True, (132, 264)),  # whole waves: data-parallel only
    (640, 64, 132, False, (132, 640)),
    (10, 64, 132, False, (10, 10)),
])
def test_schedule(tiles, k_tiles, ctas, stream_k, expected):
    assert schedule(tiles, k_tiles, ctas, stream_k) == expected


DRAFTER_TP8 = StackedLayout(5, 1, 128, False, False, "float32", "sm_90a")  # 10 column tiles


@pytest.mark.parametrize(("env", "expected"), [
    ({}, (False, 80)),  # T = 1: the swapped tile, 10 tiles of 1 MB split 8 ways
    ({"CUTE_KERNELS_STACKED_SPLITS": "3"}, (False, 30)),
    ({"CUTE_KERNELS_STACKED_SPLITS": "100"}, (False, 640)),  # 64 k-tiles, the workspace
    ({"CUTE_KERNELS_STACKED_SCHEDULE": "dp"}, (False, 10)),  # a schedule: the wgmma core
    ({"CUTE_KERNELS_STACKED_SCHEDULE": "streamk"}, (True, 132)),
    ({"CUTE_KERNELS_STACKED_SCHEDULE": "streamk", "CUTE_KERNELS_STACKED_CTAS": "7"},
     (True, 7)),
    ({"CUTE_KERNELS_STACKED_TILE": "m64h"}, (False, 20)),  # two half-head tiles a head
    ({"CUTE_KERNELS_STACKED_TILE": "m64h", "CUTE_KERNELS_STACKED_CTAS": "7"},
     (False, 6)),  # an even grid: the two halves of a head are one cluster's CTAs
    ({"CUTE_KERNELS_STACKED_TILE": "m64h", "CUTE_KERNELS_STACKED_CTAS": "1"}, (False, 2)),
])
def test_plan_overrides(env, expected, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plan = choose_plan(DRAFTER_TP8, 1, 4096, 132)
    assert (plan.stream_k, plan.grid) == expected


def test_split_head_grid_is_resident_clusters(monkeypatch):
    """The split-head plan runs no more 2-CTA clusters than are resident at once."""
    monkeypatch.setenv("CUTE_KERNELS_STACKED_TILE", "m64h")
    layout = StackedLayout(5, 8, 128, False, False, "float32", "sm_90a")  # 80 heads
    asked = []

    def residency(size: int, per_sm: int) -> int:
        asked.append((size, per_sm))
        return 124  # 62 clusters of 2 at one CTA per SM

    assert choose_plan(layout, 64, 4096, 132, residency) == StackedPlan(
        StackedVariant("wgmma", "m64h"), False, 124, 160)
    assert asked == [(2, 1)]


def test_forced_stream_k_takes_a_whole_head_tile(monkeypatch):
    """TP 8, T = 256 plans the split-head tile; with stream-K forced, the m64 tile."""
    assert choose_plan(DRAFTER_TP8, 256, 4096, 132).variant.tile == "m64h"
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SCHEDULE", "streamk")
    plan = choose_plan(DRAFTER_TP8, 256, 4096, 132)
    assert (plan.variant.tile, plan.stream_k) == ("m64", True)


def test_split_hand_over(monkeypatch):
    """T <= 16 hands the split partials over in a cluster, with at most 8 splits and only as
    many clusters as are resident at once; more token tiles with few splits, or a forced
    workspace, use the workspace; a forced cluster hand-over takes any split plan of the mma
    core."""
    layout = StackedLayout(2, 2, 128, False, False, "float32", "sm_90a")  # 8 weight tiles
    assert choose_plan(layout, 1, 4096, 132) == StackedPlan(
        StackedVariant("mma", "swap16", cluster=True), False, 64, 8, 8)
    # a forced split past 8: the workspace (the cluster hand-over sums at most 8 partials)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SPLITS", "13")
    assert choose_plan(layout, 1, 4096, 132) == StackedPlan(
        StackedVariant("mma", "swap16"), False, 104, 8, 13)
    monkeypatch.delenv("CUTE_KERNELS_STACKED_SPLITS")
    # clusters of 8 and 7 fit fewer CTAs than that: 6 splits
    residency = {8: 48, 7: 49, 6: 48}.get
    assert choose_plan(layout, 1, 4096, 132, lambda size, per_sm: residency(size, 264)) == (
        StackedPlan(StackedVariant("mma", "swap16", cluster=True), False, 48, 8, 6))
    # TP 4, T = 32 on the mma core (sm_90a plans sw32 there): 40 tiles (2 token tiles), 3
    # splits on one CTA per SM: the cluster; 2 splits of 2 token tiles (L 2, n_kv 8): the
    # workspace
    tp4 = StackedLayout(5, 2, 128, False, False, "float32", "sm_100a")
    assert choose_plan(tp4, 32, 4096, 132) == StackedPlan(
        StackedVariant("mma", "swap16", cluster=True), False, 120, 40, 3)
    two_layers = StackedLayout(2, 8, 128, False, False, "float32", "sm_100a")
    assert choose_plan(two_layers, 32, 4096, 132) == StackedPlan(
        StackedVariant("mma", "swap16"), False, 128, 64, 2)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_HANDOVER", "workspace")
    assert choose_plan(layout, 1, 4096, 132) == StackedPlan(
        StackedVariant("mma", "swap16"), False, 72, 8, 9)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_HANDOVER", "cluster")
    mma_layout = dataclasses.replace(layout, arch="sm_100a")
    assert choose_plan(mma_layout, 17, 4096, 132) == StackedPlan(
        StackedVariant("mma", "swap16", cluster=True), False, 128, 16, 8)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_IMPL", "mma")
    monkeypatch.setenv("CUTE_KERNELS_STACKED_TILE", "m64")
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SPLITS", "3")
    assert choose_plan(layout, 100, 4096, 132) == StackedPlan(
        StackedVariant("mma", "m64", cluster=True), False, 48, 16, 3)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SPLITS", "9")
    with pytest.raises(LayoutError, match="CUTE_KERNELS_STACKED_SPLITS: expected at most 8"):
        choose_plan(layout, 1, 4096, 132)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_HANDOVER", "dsmem")
    with pytest.raises(LayoutError, match="CUTE_KERNELS_STACKED_HANDOVER: expected one of"):
        choose_plan(layout, 1, 4096, 132)


def test_forced_swapped_wgmma_split(monkeypatch):
    """A swapped wgmma tile with a forced split runs its split variant: the tile's CTAs one
    cluster, never more splits than k-tiles; unsplit, one CTA per tile."""
    monkeypatch.setenv("CUTE_KERNELS_STACKED_TILE", "sw32")
    assert choose_plan(DRAFTER_TP8, 64, 4096, 132) == StackedPlan(
        StackedVariant("wgmma", "sw32"), False, 20, 20)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SPLITS", "8")
    assert choose_plan(DRAFTER_TP8, 64, 4096, 132) == StackedPlan(
        StackedVariant("wgmma", "sw32", cluster=True), False, 160, 20, 8)
    # 100 tokens: four token tiles per weight tile; H 256: 4 k-tiles, so 4 splits
    assert choose_plan(DRAFTER_TP8, 100, 256, 132) == StackedPlan(
        StackedVariant("wgmma", "sw32", cluster=True), False, 160, 40, 4)
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SPLITS", "1")
    assert choose_plan(DRAFTER_TP8, 64, 4096, 132).variant.cluster is False


def test_mma_core_has_no_stream_k(monkeypatch):
    """On sm_100a the mma core runs: data-parallel tiles (a forced stream-K schedule is the
    wgmma core's), the split swapped tile at decode sizes."""
    monkeypatch.setenv("CUTE_KERNELS_STACKED_SCHEDULE", "streamk")
    layout = dataclasses.replace(DRAFTER_TP8, arch="sm_100a")
    assert choose_plan(layout, 17, 4096, 148) == StackedPlan(StackedVariant("mma", "m64"),
                                                             False, 10, 10)
    monkeypatch.delenv("CUTE_KERNELS_STACKED_SCHEDULE")
    assert choose_plan(layout, 1, 4096, 148) == StackedPlan(
        StackedVariant("mma", "swap16", cluster=True), False, 80, 10, 8)


@pytest.mark.parametrize(("weight_tiles", "tiles", "k_tiles", "sms", "per_sm", "gathered",
                          "expected"), [
    (10, 10, 64, 132, 2, 199, 8),  # TP 8: 8 MiB over 10 rings of 108 KiB
    # TP 8, T = 64: 4 token tiles, capped so that all are resident (6 splits, 240 CTAs)
    (10, 40, 64, 132, 2, 12, 6),
    # TP 8, T = 32: 8 splits would put two CTAs on 28 SMs; 6 keep one per SM
    (10, 20, 64, 132, 2, 12, 6),
    # TP 2, T = 32: 2 splits on 160 CTAs, as busy per SM as 1 split on 80: kept
    (40, 80, 64, 132, 2, 12, 2),
    (80, 80, 64, 132, 2, 199, 1),  # TP 1: 80 rings already hold it
    (2, 2, 32, 132, 2, 199, 32),  # a 0.5 MB weight: capped at the k-tiles
    (2, 2, 64, 132, 2, 12, 12),  # 16 rows: capped at the partials one gather holds
    (2, 2, 64, 10, 2, 199, 10),  # capped so that every CTA is resident
])
def test_choose_splits(weight_tiles, tiles, k_tiles, sms, per_sm, gathered, expected,
                       monkeypatch):
    monkeypatch.delenv("CUTE_KERNELS_STACKED_SPLITS", raising=False)
    assert choose_splits(weight_tiles, tiles, k_tiles, sms, per_sm, 110592,
                         gathered) == expected


def test_kernel_entry_requires_cuda():
    with pytest.raises(LayoutError, match="CUDA"):
        stacked_kv_proj(**_args("cpu"))


def test_variants_of_a_layout_leave_out_what_it_cannot_build():
    """Precompiling a D = 256 layout builds no swapped wgmma tile (none holds 256 rows), nor
    a layout of 128 KV columns a wide one."""
    tiles = {v.tile for v in variants_for("sm_90a", 256)}
    assert "m64h" in tiles and not any(TILES[t].tokens_n for t in tiles)
    assert {v.tile for v in variants_for("sm_90a", 128)} == {v.tile for v in
                                                             variants_for("sm_90a")}
    # a wide swapped tile where kv holds no 256 columns is the narrow one: not built twice
    wide = {t for t in TILES if TILES[t].tokens_n and TILES[t].wide}
    assert wide and wide <= {v.tile for v in variants_for("sm_90a", 128, 256)}
    assert not wide & {v.tile for v in variants_for("sm_90a", 128, 128)}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_layout_plans_a_variant_its_precompile_builds(arch):
    """The issue's layout grid (H 2048..8192, L 1..6, D 64 / 128 / 256, n_kv x D 128..1024)
    at token counts from 1 to 8192, on GPUs of 78, 132 and 148 SMs: every plan is a variant
    that precompiling the layout builds (so strict mode never meets a compile at serving
    time), with a grid, at most one split per k-tile, and an mma-core cluster hand-over only
    where all its clusters are resident at once (the formula's bound; the wgmma core's split
    is lowered by the same residency inside ``decode_swapped_plan`` and not re-checked here)."""
    tokens = (1, 7, 16, 17, 32, 33, 48, 64, 65, 128, 129, 255, 256, 257, 512, 1000, 1024, 4096,
              8192)
    for hidden, layers, head_dim, kv in itertools.product(
            (2048, 2560, 4096, 5120, 8192), range(1, 7), (64, 128, 256), (128, 256, 512, 1024)):
        if kv % head_dim:
            continue
        layout = StackedLayout(layers, kv // head_dim, head_dim, False, False, "bfloat16", arch)
        built = variants_for(arch, head_dim, kv)
        for sms, t in itertools.product((78, 132, 148), tokens):
            plan = choose_plan(layout, t, hidden, sms)
            where = (hidden, layers, head_dim, kv, sms, t, plan)
            assert plan.variant in built, where
            assert plan.grid >= 1 and 1 <= plan.splits <= hidden // STACKED_K_TILE, where
            if plan.variant.cluster and plan.variant.impl == "mma":
                per_sm = swap_ring(TILES[plan.variant.tile], tile_n(head_dim, kv))[1]
                assert plan.splits <= CLUSTER_MAX_SPLITS, where
                assert plan.grid <= formula_residency(sms)(plan.splits, per_sm), where


def test_reference_out_of_range_indices_write_nothing():
    """A slot past the caches (into the guard rows behind them, or far past) or a position
    outside the cos/sin table skips its row in every cache, as a negative slot does."""
    case = make_case(40, 256, 2, 2, 128, "cpu", bias=True, out_of_range=True)
    slots_per_cache = case.k_caches[0].shape[0]
    out = ((case.cache_loc >= slots_per_cache) | (case.positions < 0)
           | (case.positions >= case.cos_sin_cache.shape[0]))
    assert 6 <= int(out.sum()) < 30
    case.poison()
    ref.stacked_kv_proj(*case.args())
    kb, vb, kc, vc = case.twin()
    for b in (*kb, *vb):
        b.view(torch.uint8).fill_(POISON)
    skipped = dataclasses.replace(
        case, cache_loc=torch.where(out, -1, case.cache_loc),
        positions=case.positions.clamp(0, case.cos_sin_cache.shape[0] - 1))
    ref.stacked_kv_proj(*skipped.args(kc, vc))
    for got, want, cache in zip((*case.k_backings, *case.v_backings), (*kb, *vb),
                                (*case.k_caches, *case.v_caches), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        guard = got.view(torch.uint8)[cache.shape[0] * cache.stride(0) * 2:]
        assert guard.numel() > 0 and bool((guard == POISON).all())
    assert _untouched(case)


def test_a_one_token_case_writes_its_row():
    """The cases skip the last of every ``skip_every`` rows, so a decode-sized case (T = 1..4)
    writes every row: a test at those sizes checks values, not only untouched poison."""
    rows, _ = make_case(1, bias=True).written_rows()
    assert rows.tolist() == [0]
    assert (make_case(12).cache_loc == -1).nonzero().view(-1).tolist() == [4, 9]
