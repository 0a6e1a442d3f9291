"""DeepSeek V4 C128 (heavily compressed attention) compressor, in one launch.

For each token on a 128-position boundary: softmax-pool its request's last 128 state rows into
one 512-dim vector, RMSNorm it, quantise dims 0..447 (UE8M0 fp8, groups of 64), rotate dims
448..511 (GPT-J RoPE at the window's first position) and write one record of the paged compressed
KV cache. Contract: specs/compress_c128.md.

Two cores with one contract, picked from the token count (:func:`.interface.core_for`). The
modules:

- :mod:`.base` — the token walk, the pooling arithmetic both cores share (so that they write
  the same bytes), the record's norm / quantisation / rotation / store, and the launch;
- :mod:`.cluster` — one window split over an 8-CTA cluster (calls of few tokens);
- :mod:`.stream` — one CTA per window on every SM, a TMA producer warp (calls of 31+ tokens);
- :mod:`.interface` — compile key, core choice, validation, build, launch and the public op.
"""

from .cluster import CompressC128
from .interface import (
    CORE_ENV,
    CORES,
    STREAM_MIN_TOKENS,
    CompressC128Key,
    check_compress_c128,
    compress_c128,
    core_for,
)
from .stream import CompressC128Stream

__all__ = ["CORES", "CORE_ENV", "STREAM_MIN_TOKENS", "CompressC128", "CompressC128Key",
           "CompressC128Stream", "check_compress_c128", "compress_c128", "core_for"]
