"""Drop-in adapters for the two call sites the kernels were built for.

- :mod:`cute_kernels.integrations.vllm`: ``insert_context_kv(attn, kv, positions, slot_mapping)``,
  the contract of vLLM's DSpark ``_insert_context_kv``, on :func:`cute_kernels.kv_rope_insert`.
- :mod:`cute_kernels.integrations.sglang`: the stacked drafter parameters of SGLang's
  ``_stacked_ctx_kv_params`` and a ``write_target_hidden_kv`` equivalent on
  :func:`cute_kernels.stacked_kv_proj`, with SGLang's per-layer path as the fallback.

Neither imports vllm or sglang: they read the attributes those projects' modules carry (duck
typing), so stand-in ``nn.Module``s work the same. Import the submodule of your engine.
"""

from __future__ import annotations

from ..validation import fail

_MISSING = object()


def require_attr(obj: object, name: str, path: str) -> object:
    """``obj.name``, or a :class:`~cute_kernels.LayoutError` naming the attribute's full path
    (``path.name``): a stand-in or a newer engine version without it fails at the adapter with
    the name, not with an ``AttributeError`` deep inside a call."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        fail(f"{path}.{name}", "an attribute", f"a {type(obj).__name__} without it")
    return value
