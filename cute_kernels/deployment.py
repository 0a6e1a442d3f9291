"""Layout plan at model load: which ops of a deployment these kernels serve, with which compiled
variants, and why not the others — before any cache or GPU exists.

A :class:`Deployment` describes a model and how it is served: a named preset (:data:`PRESETS`)
or a small JSON file. Each op section is optional (one is needed); defaults are DeepSeek V4's
numbers (what the kernels hard-code) and, for a drafter, the Qwen3 configs'::

    {
      "name": "my-v4",
      "tp": 4,
      "arch": "sm_90a",
      "kv_insert": {"caches": [{"dtype": "uint8", "block_size": 64}]},
      "compressors": [{"caches": [{"dtype": "uint8", "block_size": 2}]}],
      "drafter": {"hidden_size": 4096, "num_hidden_layers": 5, "num_key_value_heads": 8,
                  "head_dim": 128}
    }

- top level: ``name``, ``tp`` (1), ``arch`` (none: :func:`plan`'s argument or the GPU's),
  ``summary``, and the op sections below.
- ``kv_insert`` (:class:`KvInsert`, ``kv_rope_insert``): the DeepSeek V4 attention KV insert,
  e.g. the SWA cache that DSpark context insertion writes; one case per cache. ``caches``,
  ``head_dim`` (512), ``rope_dim`` (64).
- ``compressors`` (:class:`Compressor`, ``compress_c128``): compressed-attention layers, one
  entry per compress ratio, one case per compressed cache. ``caches``, ``compress_ratio`` (128),
  ``state_block_size`` (8), ``overlap`` (false), ``head_dim``, ``rope_dim``, ``norm_dtype``
  (bfloat16), ``rms_norm_eps`` (1e-6).
- ``drafter`` (:class:`Drafter`, ``stacked_kv_proj``): a DSpark/DFlash drafter's stacked K/V
  projection, one case per call form (``commit_lens``: false = ``cache_loc``, true =
  ``cache_loc_2d`` with ``commit_lens``; both by default). ``hidden_size``,
  ``num_hidden_layers`` (at most 4096), ``num_key_value_heads`` (the total: a TP rank holds
  ``max(1, heads // tp)``), ``head_dim``, ``rope_dim`` (head_dim), ``attention_bias`` (false),
  ``dtype``, ``weight_dtype``, ``kv_cache_dtype`` (bfloat16), ``norm_dtype`` (float32),
  ``rms_norm_eps`` (1e-6).
- a cache (:class:`KvCache`): ``dtype`` (a torch dtype name), ``block_size``, ``kv_mxfp8``
  (uint8 only; false: V4 584-byte record, true: V4.1 528, ``"auto"``: true on SM100-family
  archs, as vLLM picks it), ``width`` (the format's record width), ``page_align`` (vLLM's
  padding).

:func:`plan` builds ``meta`` tensors with the shapes, strides and dtypes a serving engine passes
and runs each op's own validation on them (``op.validate``, what every call runs), so a plan and
the calls cannot disagree: each case is supported with its compile keys, or rejected with the
exact :class:`~cute_kernels.LayoutError` a call would raise. A description that cannot be
planned (unknown preset or field, wrong type, a file that is not UTF-8 JSON, sizes no tensor can
have) raises :class:`DeploymentError` naming the field (or the section, or the file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .arch import ARCH_ENV, arch_for
from .compile_cache import CompileKey, families
from .compress_c128 import CORES as C128_CORES
from .compress_c128 import compress_c128
from .kv_rope_insert import kv_rope_insert
from .layouts import C128_RATIO, C128_STATE_BLOCK, CACHE_DTYPES, HEAD_DIM, ROPE_DIM, cache_format
from .stacked_kv_proj.interface import StackedKvProjKey, stacked_kv_proj
from .stacked_kv_proj.plan import variants_for
from .validation import LayoutError, describe, fail

# Sizes of the meta tensors. No compile key depends on them (token, page, slot and table counts
# are runtime values); more than one page and slot, so the page- and row-stride checks run.
TOKENS = 8  # and 2 requests x 4 commit columns for cache_loc_2d
PAGES = 4
STATE_PAGES = 32
REQUESTS = 2
SLOTS = 64
MAX_POS = 4096


class DeploymentError(ValueError):
    """A deployment description that cannot be planned: an unknown preset or field, a missing
    field, a value of the wrong type. The message names the field (``drafter.head_dim``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem

    def under(self, parent: str) -> DeploymentError:
        """The same error, with its field named from the enclosing section ``parent``."""
        if not self.field:
            return DeploymentError(parent, self.problem)
        sep = "" if self.field.startswith("[") else "."
        return DeploymentError(f"{parent}{sep}{self.field}", self.problem)


# -- field parsers: value -> normalised value, or DeploymentError (field named by the caller) --


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DeploymentError("", f"expected a positive integer, got {describe(value)}")
    return value


#: The most layers a drafter description may have: plan() builds two meta tensors a layer
#: (the stacked op itself takes at most STACKED_MAX_LAYERS; a larger count is a rejected case).
MAX_DESCRIBED_LAYERS = 4096


def _layer_count(value: object) -> int:
    count = _positive_int(value)
    if count > MAX_DESCRIBED_LAYERS:
        raise DeploymentError("", f"expected at most {MAX_DESCRIBED_LAYERS} layers, got {count}")
    return count


def _number(value: object) -> float:
    # The range (finite, >= 0) is the ops' to check: an eps they reject is a plan result.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeploymentError("", f"expected a number, got {describe(value)}")
    return float(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise DeploymentError("", f"expected true or false, got {describe(value)}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise DeploymentError("", f"expected a string, got {describe(value)}")
    return value


def _name(value: object) -> str:
    if not _text(value):
        raise DeploymentError("", "expected a non-empty string")
    return value  # type: ignore[return-value]


def _dtype_name(value: object) -> str:
    """A torch dtype name, normalised (``torch.float`` and ``float`` are ``float32``)."""
    dtype = getattr(torch, _text(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DeploymentError("", f"expected a torch dtype name such as bfloat16, float32, "
                                  f"uint8, float8_e4m3fn or int8, got {value!r}")
    return str(dtype).removeprefix("torch.")


def _mxfp8(value: object) -> bool | str:
    if value == "auto":
        return "auto"
    if not isinstance(value, bool):
        raise DeploymentError("", f'expected true, false or "auto", got {describe(value)}')
    return value


def _optional(parse: Callable[[object], Any]) -> Callable[[object], Any]:
    return lambda value: None if value is None else parse(value)


def _bools(value: object) -> tuple[bool, ...]:
    """A non-empty list of distinct booleans."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DeploymentError("", f"expected a non-empty list of booleans, got {describe(value)}")
    items = tuple(_bool(v) for v in value)
    if len(set(items)) != len(items):
        raise DeploymentError("", f"expected distinct values, got {list(items)}")
    return items


def _section(cls: type) -> Callable[[object], Any]:
    def parse(value: object) -> Any:
        return value if isinstance(value, cls) else cls.from_json(value)

    return parse


def _sections(cls: type, non_empty: bool) -> Callable[[object], tuple]:
    def parse(value: object) -> tuple:
        if not isinstance(value, (list, tuple)) or (non_empty and not value):
            kind = "a non-empty list" if non_empty else "a list"
            raise DeploymentError("", f"expected {kind} of objects, got {describe(value)}")
        items = []
        for i, item in enumerate(value):
            try:
                items.append(_section(cls)(item))
            except DeploymentError as e:
                raise e.under(f"[{i}]") from None
        return tuple(items)

    return parse


def _field(parse: Callable[[object], Any], default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"parse": parse})


class _Section:
    """A frozen description section whose fields are checked and normalised on construction,
    from Python (``dataclasses.replace`` included) or from JSON."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            try:
                value = f.metadata["parse"](getattr(self, f.name))
            except DeploymentError as e:
                raise e.under(f.name) from None
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_json(cls, data: object) -> Any:
        """The section of a parsed JSON object; unknown and missing fields are errors."""
        if not isinstance(data, Mapping):
            raise DeploymentError("", f"expected a JSON object, got {describe(data)}")
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        known = [f.name for f in fields]
        for name in data:
            if name not in known:
                raise DeploymentError(str(name), f"unknown field; known: {', '.join(known)}")
        for f in fields:
            if f.name not in data and f.default is dataclasses.MISSING:
                raise DeploymentError(f.name, "missing (a required field)")
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        """Every field (defaults included); :meth:`from_json` of it gives an equal section."""
        return {f.name: _jsonable(getattr(self, f.name))
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]


def _jsonable(value: Any) -> Any:
    if isinstance(value, _Section):
        return value.to_json()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


# -- the description ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KvCache(_Section):
    """One paged KV cache ``[pages, block_size, width]``."""

    dtype: str = _field(_dtype_name)
    block_size: int = _field(_positive_int)
    #: uint8 only: False = V4 record (584), True = V4.1 record (528), "auto" = True on
    #: SM100-family archs (vLLM enables kv_mxfp8 on those GPUs only).
    kv_mxfp8: bool | str = _field(_mxfp8, False)
    #: Record width; None = the format's (584 / 528 for uint8 by kv_mxfp8, else the head dim).
    width: int | None = _field(_optional(_positive_int), None)
    #: Pages are padded to a multiple of this many bytes; None = as vLLM pads them: a packed page
    #: to a multiple of its data row (576 bytes for V4, 512 for V4.1; vLLM's compressor tests
    #: give round_up(KB * 584, 576), its SWA cache formula is UNCONFIRMED), a plain cache not at
    #: all.
    page_align: int | None = _field(_optional(_positive_int), None)


@dataclasses.dataclass(frozen=True)
class KvInsert(_Section):
    """A DeepSeek V4/V4.1 attention KV insert (``kv_rope_insert``): one case per cache."""

    caches: tuple[KvCache, ...] = _field(_sections(KvCache, non_empty=True))
    head_dim: int = _field(_positive_int, HEAD_DIM)
    rope_dim: int = _field(_positive_int, ROPE_DIM)


@dataclasses.dataclass(frozen=True)
class Compressor(_Section):
    """Compressed-attention layers of one ratio (``compress_c128``): one case per cache."""

    caches: tuple[KvCache, ...] = _field(_sections(KvCache, non_empty=True))
    compress_ratio: int = _field(_positive_int, C128_RATIO)
    state_block_size: int = _field(_positive_int, C128_STATE_BLOCK)
    #: Overlapping windows (V4's C4) keep two kv | score halves per state row.
    overlap: bool = _field(_bool, False)
    head_dim: int = _field(_positive_int, HEAD_DIM)
    rope_dim: int = _field(_positive_int, ROPE_DIM)
    norm_dtype: str = _field(_dtype_name, "bfloat16")
    rms_norm_eps: float = _field(_number, 1e-6)


@dataclasses.dataclass(frozen=True)
class Drafter(_Section):
    """A DSpark/DFlash drafter's stacked K/V projection (``stacked_kv_proj``). Head counts are
    totals over the TP group; names follow the Hugging Face config."""

    hidden_size: int = _field(_positive_int)
    num_hidden_layers: int = _field(_layer_count)
    num_key_value_heads: int = _field(_positive_int)
    head_dim: int = _field(_positive_int)
    rope_dim: int | None = _field(_optional(_positive_int), None)  # None = head_dim (full)
    attention_bias: bool = _field(_bool, False)
    dtype: str = _field(_dtype_name, "bfloat16")  # activations and bias
    weight_dtype: str = _field(_dtype_name, "bfloat16")  # fp8/int8 = a quantised checkpoint
    norm_dtype: str = _field(_dtype_name, "float32")  # the stacked k_norm weight
    kv_cache_dtype: str = _field(_dtype_name, "bfloat16")
    rms_norm_eps: float = _field(_number, 1e-6)
    #: The call forms the engine uses: False = cache_loc (prefill / extend), True = cache_loc_2d
    #: with commit_lens (verify / commit injection).
    commit_lens: tuple[bool, ...] = _field(_bools, (False, True))


@dataclasses.dataclass(frozen=True)
class Deployment(_Section):
    """A model and how it is served; see the module doc for the JSON form."""

    name: str = _field(_name)
    tp: int = _field(_positive_int, 1)
    arch: str | None = _field(_optional(_text), None)  # None: plan()'s argument or the GPU's
    summary: str = _field(_text, "")
    kv_insert: KvInsert | None = _field(_optional(_section(KvInsert)), None)
    compressors: tuple[Compressor, ...] = _field(_sections(Compressor, non_empty=False), ())
    drafter: Drafter | None = _field(_optional(_section(Drafter)), None)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_insert is None and not self.compressors and self.drafter is None:
            raise DeploymentError("", "describes no op: give kv_insert, compressors or drafter")
        if self.drafter is not None:
            _kv_heads_per_rank(self.drafter.num_key_value_heads, self.tp)


def _kv_heads_per_rank(heads: int, tp: int) -> int:
    """KV heads of one TP rank: split when ``tp`` divides them, replicated when they divide
    ``tp`` (as vLLM and SGLang shard a QKV projection)."""
    if heads % tp and tp % heads:
        raise DeploymentError("tp", f"{tp} ranks cannot share the drafter's {heads} KV heads "
                                    "(one must divide the other)")
    return max(1, heads // tp)


def load_deployment(source: Deployment | Mapping | str | os.PathLike) -> Deployment:
    """A deployment from a :class:`Deployment`, a parsed JSON object, a preset name or the path
    of a JSON file."""
    if isinstance(source, Deployment):
        return source
    if isinstance(source, Mapping):
        return Deployment.from_json(source)
    if isinstance(source, str) and source in PRESETS:
        return PRESETS[source]
    if not isinstance(source, (str, os.PathLike)):
        raise DeploymentError("", "expected a Deployment, a parsed JSON object, a preset name or "
                                  f"the path of a JSON file, got {describe(source)}")
    path = Path(source)
    if not path.is_file():
        raise DeploymentError("", f"{str(source)!r} is neither a preset ({', '.join(PRESETS)}) "
                                  "nor a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:  # unreadable (permissions, a file gone since is_file)
        raise DeploymentError("", f"{path} cannot be read: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise DeploymentError("", f"{path} is not valid JSON: {e}") from None
    return Deployment.from_json(data)


# -- the plan -----------------------------------------------------------------------------------


def key_text(key: Any) -> str:
    """A compile key as one line: enums by value, nested keys inline, strings unquoted."""
    parts = []
    for f in dataclasses.fields(key):
        value = getattr(key, f.name)
        if dataclasses.is_dataclass(value):
            value = key_text(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        parts.append(f"{f.name}={value}")
    return f"{type(key).__name__}({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class Case:
    """One call layout of an op: its compile keys, or the LayoutError a call would raise."""

    op: str  # the public op, also its compile-cache family
    case: str
    keys: tuple[CompileKey, ...] = ()
    error: str | None = None

    @property
    def supported(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case, "supported": self.supported,
                "keys": [key_text(k) for k in self.keys], "error": self.error}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`plan` found: every case of every op the deployment uses, on ``arch``."""

    deployment: Deployment
    arch: str
    cases: tuple[Case, ...]

    def ops(self) -> dict[str, list[Case]]:
        """The cases by op, in plan order."""
        ops: dict[str, list[Case]] = {}
        for case in self.cases:
            ops.setdefault(case.op, []).append(case)
        return ops

    def supported(self, op: str) -> bool:
        """Whether every case of ``op`` is supported (KeyError if the deployment has no ``op``)."""
        return all(case.supported for case in self.ops()[op])

    def keys(self) -> dict[str, list[CompileKey]]:
        """The distinct compile keys of the supported cases, by op (= compile-cache family)."""
        keys: dict[str, dict[CompileKey, None]] = {}
        for case in self.cases:
            keys.setdefault(case.op, {}).update(dict.fromkeys(case.keys))
        return {op: list(op_keys) for op, op_keys in keys.items()}

    def to_json(self) -> dict[str, Any]:
        keys = self.keys()
        return {
            "deployment": self.deployment.to_json(),
            "arch": self.arch,
            "tp": self.deployment.tp,
            "variants": sum(len(k) for k in keys.values()),
            "ops": {op: {"supported": self.supported(op),
                         "keys": [key_text(k) for k in keys[op]],
                         "cases": [case.to_json() for case in cases]}
                    for op, cases in self.ops().items()},
        }

    def table(self) -> str:
        """The plan for people: one row per case, then the compile keys."""
        keys = self.keys()
        count = sum(len(k) for k in keys.values())
        rows = [("op", "case", "result")]
        for case in self.cases:
            n = len(case.keys)
            result = (f"ok, {n} variant{'s' if n != 1 else ''}" if case.supported
                      else f"REJECTED  {case.error}")
            rows.append((case.op, case.case, result))
        op_w = max(len(r[0]) for r in rows)
        case_w = max(len(r[1]) for r in rows)
        lines = [f"{self.deployment.name}: arch {self.arch}, TP {self.deployment.tp}, "
                 f"{count} compile variant{'s' if count != 1 else ''}", ""]
        lines += [f"{op:<{op_w}}  {case:<{case_w}}  {result}".rstrip() for op, case, result in rows]
        lines += ["", "compile keys:"]
        lines += [f"  {key_text(key)}" for op_keys in keys.values() for key in op_keys]
        return "\n".join(lines)


def default_arch() -> str:
    """The arch ``CUTE_KERNELS_ARCH`` names, else the current CUDA device's; without either, a
    RuntimeError that says what to pass (torch's own error would not)."""
    if os.environ.get(ARCH_ENV) is None and not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA device to take the target arch from; pass one "
            "(arch='sm_90a' or arch='sm_100a' in Python, --arch on the command line) "
            f"or set {ARCH_ENV}=sm_90a")
    return arch_for(torch.device("cuda"))  # type: ignore[return-value]


@contextlib.contextmanager
def _arch_env(arch: str) -> Iterator[None]:
    """Validation of meta tensors reads the arch from ``CUTE_KERNELS_ARCH``: name ``arch`` there
    for the duration (so a plan is made for the deployment's arch, not the build box's)."""
    previous = os.environ.get(ARCH_ENV)
    os.environ[ARCH_ENV] = arch
    try:
        yield
    finally:
        if previous is None:
            del os.environ[ARCH_ENV]
        else:
            os.environ[ARCH_ENV] = previous


def _meta(shape: Sequence[int], dtype: str | torch.dtype,
          strides: Sequence[int] | None = None) -> torch.Tensor:
    """A meta tensor of the description's sizes; a DeploymentError (its section named by the
    caller) when no tensor can have them (a size or the byte count past 64 bits)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    try:
        if strides is None:
            return torch.empty(tuple(shape), dtype=dtype, device="meta")
        return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype, device="meta")
    except (RuntimeError, TypeError, OverflowError) as err:
        layout = f"shape {tuple(shape)}" + ("" if strides is None else
                                             f" and strides {tuple(strides)}")
        reason = str(err).splitlines()[0]
        raise DeploymentError("", f"sizes no {dtype} tensor can have: {layout} "
                                  f"({reason})") from None


def _index(dtype: torch.dtype = torch.int64, length: int = TOKENS) -> torch.Tensor:
    return _meta((length,), dtype)


def _fp8_scale(cache: torch.Tensor) -> torch.Tensor | None:
    """The per-tensor scale an engine passes with an fp8 cache (None with any other)."""
    return _meta((1,), torch.float32) if cache.dtype == torch.float8_e4m3fn else None


def _sm_major(arch: str) -> int | None:
    match = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    return int(match.group(1)) // 10 if match else None


def _paged_cache(cache: KvCache, head_dim: int, arch: str) -> tuple[torch.Tensor, bool, str]:
    """The cache tensor an engine allocates, its kv_mxfp8 flag, and a label for the case."""
    dtype = getattr(torch, cache.dtype)
    mxfp8 = (_sm_major(arch) == 10) if cache.kv_mxfp8 == "auto" else bool(cache.kv_mxfp8)
    fmt = cache_format(dtype, mxfp8) if dtype in CACHE_DTYPES else None
    packed = fmt is not None and fmt.packed
    width = cache.width or (fmt.record_width if packed else head_dim)
    elem = dtype.itemsize
    align = cache.page_align or (fmt.data_bytes if packed else 1)
    align = math.lcm(align, elem)  # a page stride is whole elements
    page_bytes = -(-cache.block_size * width * elem // align) * align
    tensor = _meta((PAGES, cache.block_size, width), dtype, (page_bytes // elem, width, 1))
    label = f"k_cache {cache.dtype} [*, {cache.block_size}, {width}]"
    if dtype == torch.uint8 and mxfp8:
        label += " kv_mxfp8"
    return tensor, mxfp8, label


def _check(op: str, label: str, validate: Callable[[], Any],
           keys: Callable[[Any], tuple[CompileKey, ...]] = lambda key: (key,)) -> Case:
    try:
        return Case(op, label, keys(validate()))
    except LayoutError as e:
        return Case(op, label, error=str(e))


def _kv_insert_cases(spec: KvInsert, arch: str) -> list[Case]:
    cases = []
    for cache in spec.caches:
        k_cache, mxfp8, label = _paged_cache(cache, spec.head_dim, arch)
        args = (_meta((TOKENS, spec.head_dim), torch.bfloat16), k_cache, _index(), _index(),
                _meta((MAX_POS, spec.rope_dim), torch.float32), cache.block_size,
                _fp8_scale(k_cache), mxfp8)
        cases.append(_check("kv_rope_insert", label,
                            lambda args=args: kv_rope_insert.validate(*args)))
    return cases


def _compressor_cases(spec: Compressor, arch: str) -> list[Case]:
    # State rows are kv | score of the head width (twice that with overlapping windows); a
    # request's table covers 16 pages (one window of 128 positions at 8 per page).
    halves = 4 if spec.overlap else 2
    state = _meta((STATE_PAGES, spec.state_block_size, halves * spec.head_dim), torch.float32)
    pages_per_request = STATE_PAGES // REQUESTS
    cases = []
    for cache in spec.caches:
        k_cache, _, label = _paged_cache(cache, spec.head_dim, arch)
        args = (state, _meta((REQUESTS, pages_per_request), torch.int32), _index(torch.int32),
                _index(), _index(), _meta((spec.head_dim,), spec.norm_dtype), spec.rms_norm_eps,
                _meta((MAX_POS, spec.rope_dim), torch.float32), k_cache, _index(),
                cache.block_size, _fp8_scale(k_cache))

        def validate(args: tuple = args) -> Any:
            key = compress_c128.validate(*args)
            # The ratio is in no tensor (the kernel pools fixed windows): checked here.
            if spec.compress_ratio != C128_RATIO:
                fail("compress_ratio", f"{C128_RATIO} (compress_c128 pools windows of "
                     f"{C128_RATIO} positions)", spec.compress_ratio)
            return key

        # both cores of the layout: a call picks one from its token count
        cases.append(_check("compress_c128", f"C{spec.compress_ratio} {label}", validate,
                            lambda key: tuple(dataclasses.replace(key, core=core)
                                              for core in C128_CORES)))
    return cases


def _drafter_cases(spec: Drafter, tp: int, arch: str) -> list[Case]:
    n_kv = _kv_heads_per_rank(spec.num_key_value_heads, tp)
    layers, dim, hidden = spec.num_hidden_layers, spec.head_dim, spec.hidden_size
    rows = layers * 2 * n_kv * dim
    ctx = _meta((TOKENS, hidden), spec.dtype)
    weight = _meta((rows, hidden), spec.weight_dtype)
    bias = _meta((rows,), spec.dtype) if spec.attention_bias else None
    norm = _meta((layers, dim), spec.norm_dtype)
    cos_sin = _meta((MAX_POS, spec.rope_dim or dim), torch.float32)
    k_caches = [_meta((SLOTS, n_kv, dim), spec.kv_cache_dtype) for _ in range(layers)]
    v_caches = [_meta((SLOTS, n_kv, dim), spec.kv_cache_dtype) for _ in range(layers)]
    # Every variant (core, tile) of the arch: a call picks one from its token count.
    variants = variants_for(arch, dim, n_kv * dim)
    cases = []
    for commit in spec.commit_lens:
        loc_2d = _meta((REQUESTS, TOKENS // REQUESTS), torch.int64) if commit else None
        lens = _index(torch.int32, REQUESTS) if commit else None
        args = (ctx, weight, bias, norm, spec.rms_norm_eps, _index(), cos_sin, _index(),
                k_caches, v_caches, loc_2d, lens)
        label = (f"L {layers}, {n_kv} x {dim} KV per rank, H {hidden}, "
                 + ("cache_loc_2d + commit_lens" if commit else "cache_loc"))
        cases.append(_check(
            "stacked_kv_proj", label, lambda args=args: stacked_kv_proj.validate(*args),
            lambda layout: tuple(StackedKvProjKey(layout, v) for v in variants)))
    return cases


def plan(deployment: Deployment | Mapping | str | os.PathLike, *, arch: str | None = None,
         tp: int | None = None) -> Plan:
    """Which ops of ``deployment`` (a :class:`Deployment`, parsed JSON, a preset name or a JSON
    path) these kernels serve on ``arch``, with which compile keys, and why not the others.

    ``arch``: default the description's, else ``CUTE_KERNELS_ARCH`` or the current GPU's; an
    arch the kernels do not support makes every case a rejection that says so. ``tp`` replaces
    the description's TP size. Reads metadata only (``meta`` tensors: no GPU, no allocation);
    sets ``CUTE_KERNELS_ARCH`` while it runs, so do not plan from two threads at once.
    """
    dep = load_deployment(deployment)
    if tp is not None:
        dep = dataclasses.replace(dep, tp=tp)
    target = arch or dep.arch or default_arch()
    if not isinstance(target, str):
        raise DeploymentError("arch", f"expected an arch name such as sm_90a, got "
                                      f"{describe(target)}")
    cases: list[Case] = []
    with _arch_env(target):
        if dep.kv_insert is not None:
            with _section_named("kv_insert"):
                cases += _kv_insert_cases(dep.kv_insert, target)
        for i, compressor in enumerate(dep.compressors):
            with _section_named(f"compressors[{i}]"):
                cases += _compressor_cases(compressor, target)
        if dep.drafter is not None:
            with _section_named("drafter"):
                cases += _drafter_cases(dep.drafter, dep.tp, target)
    return Plan(dep, target, tuple(cases))


@contextlib.contextmanager
def _section_named(section: str) -> Iterator[None]:
    """A DeploymentError raised while a section's tensors are built, named from ``section``."""
    try:
        yield
    except DeploymentError as err:
        raise err.under(section) from None


def build(keys: Sequence[tuple[str, CompileKey]], progress: bool | None = None) -> None:
    """Each ``(family, key)`` loaded from the disk cache or compiled, and on the disk
    (:meth:`KernelCache.precompile`), with a progress bar (``progress=None``: on a terminal
    only)."""
    caches = families()
    bar = tqdm(keys, desc="cute_kernels precompile", unit="variant",
               disable=None if progress is None else not progress)
    for family, key in bar:
        bar.set_postfix_str(family, refresh=False)
        caches[family].precompile([key])


# -- presets ------------------------------------------------------------------------------------
# A preset is a model served one way; its TP size is plan()'s argument (``--tp``), 1 by default.
#
# DeepSeek V4: one 512-dim KV latent (448 NoPE + 64 RoPE dims) shared by every query head, so
# each TP rank holds whole records and TP changes no shape of kv_rope_insert or compress_c128.
# DeepSeek-V4-Flash config.json, as quoted by public vLLM tests (UNCONFIRMED against the model
# hub): head_dim 512, qk_rope_head_dim 64, rms_norm_eps 1e-6, compress_ratios
# [0, 0, 4, 128, 4, 128, ...] (sliding-window, C4 and C128 layers). The compressor's norm weight
# is in the model dtype (bf16).
#
# KV insert (DSpark context insertion writes the SWA cache, once per draft layer): vLLM's
# DeepSeek V4.1 attention uses SWA block 32 (64 on SM120/121) and vLLM's insert tests 256; the
# cache is uint8 (packed record), bf16 or fp8. vLLM enables the V4.1 mxfp8 record on SM100-family
# GPUs only ("auto").
_SWA_BLOCK_SIZES = (32, 64, 256)
# Compressed caches: the packed record at vLLM's block 256 / ratio 128 = 2 records per page (as
# vLLM's compressor tools), and 64 as vLLM's full-cache tests; the C4 cache at 64 per page. The
# bf16/fp8 full caches are the FlashInfer/TRT-LLM backends' layout.
_C128_BLOCK_SIZES = (2, 64)
_C4_BLOCK_SIZE = 64
_PLAIN_DTYPES = ("bfloat16", "float8_e4m3fn")


def _deepseek_v4(name: str, kv_mxfp8: bool | str, summary: str) -> Deployment:
    def caches(block_sizes: Sequence[int]) -> tuple[KvCache, ...]:
        packed = tuple(KvCache("uint8", bs, kv_mxfp8) for bs in block_sizes)
        return packed + tuple(KvCache(d, bs) for d in _PLAIN_DTYPES for bs in block_sizes)

    return Deployment(
        name=name, summary=summary,
        kv_insert=KvInsert(caches(_SWA_BLOCK_SIZES)),
        compressors=(
            Compressor(caches(_C128_BLOCK_SIZES)),
            # C4 (CSA): overlapping windows of 4 positions, state block 4 (vLLM's
            # CompressorStateCache); compress_c128 is not its kernel: planned to say so.
            Compressor((KvCache("uint8", _C4_BLOCK_SIZE, kv_mxfp8),), compress_ratio=4,
                       state_block_size=4, overlap=True),
        ),
    )


def _qwen3_drafter(name: str, hidden: int, norm_dtype: str, summary: str) -> Deployment:
    # Qwen3-4B/8B/14B config.json: hidden_size 2560 / 4096 / 5120, num_key_value_heads 8,
    # head_dim 128, rms_norm_eps 1e-6, attention_bias false, bf16, full-dim NeoX RoPE. The
    # drafters copy the target's attention dims with 5 layers (DeepSpec's DSpark configs:
    # num_draft_layers 5; deepseek-ai/dspark_qwen3_4b_block7 and _8b_block7; z-lab's DFlash-b16
    # drafters). UNCONFIRMED here: the 8B and 14B config files were not read (published target
    # dims), and no 14B drafter config was (5 layers as its siblings).
    return Deployment(
        name=name, summary=summary,
        drafter=Drafter(hidden_size=hidden, num_hidden_layers=5, num_key_value_heads=8,
                        head_dim=128, norm_dtype=norm_dtype),
    )


def _presets() -> dict[str, Deployment]:
    presets = [
        _deepseek_v4("deepseek-v4-flash", False,
                     "DeepSeek V4-Flash: SWA KV insert (V4 584 / bf16 / fp8, blocks 32/64/256) "
                     "and C128 + C4 compressors"),
        # The compressed caches follow the model's record; that V4.1 keeps V4's compressor
        # layers with its mxfp8 record is UNCONFIRMED (compress_c128 writes no 528 record).
        _deepseek_v4("deepseek-v4.1-flash", "auto",
                     "DeepSeek V4.1-Flash: as V4, with the mxfp8 528 record on SM100-family "
                     "archs"),
    ]
    for size, hidden in (("4b", 2560), ("8b", 4096), ("14b", 5120)):
        # SGLang's DSpark stacks the k_norm weights as fp32; DFlash keeps each layer's in the
        # model dtype (bf16). DFlash's own fused write does not round between norm and RoPE
        # (this op does, as DSpark): the plan states layout support, not bit parity.
        presets.append(_qwen3_drafter(f"qwen3-{size}-dspark", hidden, "float32",
                                      f"Qwen3-{size.upper()} DSpark drafter, stacked K/V "
                                      "projection"))
        presets.append(_qwen3_drafter(f"qwen3-{size}-dflash", hidden, "bfloat16",
                                      f"Qwen3-{size.upper()} DFlash drafter, stacked K/V "
                                      "projection"))
    return {p.name: p for p in presets}


#: The deployments of the specs, by name (TP 1; pass ``tp`` to :func:`plan`).
PRESETS: dict[str, Deployment] = _presets()

__all__ = [
    "PRESETS",
    "Case",
    "Compressor",
    "Deployment",
    "DeploymentError",
    "Drafter",
    "KvCache",
    "KvInsert",
    "Plan",
    "build",
    "default_arch",
    "key_text",
    "load_deployment",
    "plan",
]
