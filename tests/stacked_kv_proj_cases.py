"""Inputs for the stacked KV projection tests and benchmark: per-layer caches with padded row
strides and poison fill, scattered slots with every fifth one -1, optional bias,
``cache_loc_2d`` / ``commit_lens`` rows, distinct per-layer k-norm weights (a wrong layer or a
wrong slice fails), and a real NeoX cos/sin table."""

from __future__ import annotations

import dataclasses

import torch

POISON = 0xA5  # every byte of a fresh cache backing; 0xA5A5 is a finite bf16 (~ -2.9e-16)
ROPE_THETA = 1e6


def rope_table(max_pos: int, head_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """fp32 [max_pos, D]: cos of the D/2 frequencies, then their sin (NeoX layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def commit_width(tokens: int) -> int:
    """A request width W dividing T (7/8 as in DSpark verify blocks; T itself otherwise)."""
    for w in (8, 7):
        if tokens % w == 0:
            return w
    return tokens


@dataclasses.dataclass
class StackedCase:
    ctx_hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    k_norm_weight: torch.Tensor
    eps: float
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    cache_loc: torch.Tensor
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    k_backings: list[torch.Tensor]  # whole allocations behind the caches, padding included
    v_backings: list[torch.Tensor]
    cache_loc_2d: torch.Tensor | None
    commit_lens: torch.Tensor | None

    @property
    def num_layers(self) -> int:
        return len(self.k_caches)

    def args(self, k_caches=None, v_caches=None) -> tuple:
        return (self.ctx_hidden, self.weight, self.bias, self.k_norm_weight, self.eps,
                self.positions, self.cos_sin_cache, self.cache_loc,
                self.k_caches if k_caches is None else k_caches,
                self.v_caches if v_caches is None else v_caches,
                self.cache_loc_2d, self.commit_lens)

    def poison(self) -> None:
        for b in (*self.k_backings, *self.v_backings):
            b.view(torch.uint8).fill_(POISON)

    def twin(self) -> tuple[list, list, list, list]:
        """Copies of the backings with the same strides (for the reference), and their views:
        (k_backings, v_backings, k_caches, v_caches)."""
        kb = [b.clone() for b in self.k_backings]
        vb = [b.clone() for b in self.v_backings]
        kc = [b.as_strided(c.shape, c.stride()) for b, c in zip(kb, self.k_caches, strict=True)]
        vc = [b.as_strided(c.shape, c.stride()) for b, c in zip(vb, self.v_caches, strict=True)]
        return kb, vb, kc, vc

    def written_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows that write, their slots), from the documented rules."""
        from cute_kernels.reference import stacked_kv_slots

        return stacked_kv_slots(self.cache_loc, self.cache_loc_2d, self.commit_lens)


def make_case(
    tokens: int,
    hidden: int = 256,
    num_layers: int = 2,
    n_kv: int = 2,
    head_dim: int = 128,
    device: str | torch.device = "cpu",
    *,
    bias: bool = False,
    commit: bool = False,
    row_pad: int = 0,
    norm_dtype: torch.dtype = torch.float32,
    skip_every: int = 5,
    extra_slots: int = 16,
    max_pos: int = 4096,
    eps: float = 1e-6,
    seed: int = 0,
) -> StackedCase:
    """``row_pad`` extra elements per cache row (a multiple of 8 keeps rows 16-byte aligned)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)  # generate where the data lives
    kv = n_kv * head_dim
    rows = num_layers * 2 * kv
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(rows, hidden, generator=gen, device=dev) / hidden ** 0.5).to(torch.bfloat16)
    b = None
    if bias:
        b = (0.5 * torch.randn(rows, generator=gen, device=dev)).to(torch.bfloat16)
    norm_w = 1.0 + 0.25 * torch.randn(num_layers, head_dim, generator=gen, device=dev)
    norm_w = norm_w.to(norm_dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=dev)
    slots = tokens + extra_slots
    loc = torch.randperm(slots, generator=gen, device=dev)[:tokens]
    if skip_every:
        loc[::skip_every] = -1
    loc_2d = lens = None
    if commit:
        width = commit_width(tokens)
        bs = tokens // width
        loc_2d = loc.reshape(bs, width).clone()
        lens = torch.randint(0, width + 1, (bs,), generator=gen, device=dev).to(torch.int32)
        lens[0] = width  # at least one full request
        loc = torch.full_like(loc, -1)  # replaced by cache_loc_2d: must be ignored

    stride0 = kv + row_pad

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        backing = torch.empty(slots * stride0, dtype=torch.bfloat16, device=device)
        backing.view(torch.uint8).fill_(POISON)
        return backing, backing.as_strided((slots, n_kv, head_dim), (stride0, head_dim, 1))

    ks = [cache() for _ in range(num_layers)]
    vs = [cache() for _ in range(num_layers)]
    return StackedCase(
        ctx_hidden=x, weight=w, bias=b, k_norm_weight=norm_w, eps=eps, positions=positions,
        cos_sin_cache=rope_table(max_pos, head_dim).to(dev), cache_loc=loc,
        k_caches=[c for _, c in ks], v_caches=[c for _, c in vs],
        k_backings=[b for b, _ in ks], v_backings=[b for b, _ in vs],
        cache_loc_2d=loc_2d, commit_lens=lens,
    )


def ulp_distance(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (steps between representable values; +0 and -0 are equal)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(got) - ordered(want)).abs()


@dataclasses.dataclass
class Comparison:
    within_one_ulp: float  # fraction of written K/V elements within 1 bf16 ulp
    max_ulp: int
    untouched_equal: bool  # every element of every row not written still holds the poison
    elements: int = 0  # written K/V elements compared

    @property
    def exact_enough(self) -> bool:
        return self.within_one_ulp >= 0.999 and self.untouched_equal


def compare(case: StackedCase, ref_k: list[torch.Tensor], ref_v: list[torch.Tensor],
            assert_close: bool = True) -> Comparison:
    """Kernel caches (``case``) against reference caches (same strides). Written rows: ulp
    statistics and ``assert_close(rtol=atol=2e-2)``; every other row (and the row padding)
    must still be poison."""
    _, slots = case.written_rows()
    near = total = 0
    max_ulp = 0
    untouched = True
    for got_c, want_c, got_b in zip((*case.k_caches, *case.v_caches), (*ref_k, *ref_v),
                                    (*case.k_backings, *case.v_backings), strict=True):
        got, want = got_c[slots], want_c[slots]
        if slots.numel():
            d = ulp_distance(got, want)
            near += int((d <= 1).sum())
            total += d.numel()
            max_ulp = max(max_ulp, int(d.max()))
            if assert_close:
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        mask = torch.ones(got_b.numel(), dtype=torch.bool, device=got_b.device)
        stride0 = got_c.stride(0)
        width = got_c.shape[1] * got_c.shape[2]
        cols = torch.arange(width, device=got_b.device)
        mask[(slots[:, None] * stride0 + cols[None, :]).reshape(-1)] = False
        untouched &= bool((got_b.view(torch.uint8).view(-1, 2)[mask] == POISON).all())
    frac = near / total if total else 1.0
    return Comparison(frac, max_ulp, untouched, total)
