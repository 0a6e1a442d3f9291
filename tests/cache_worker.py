"""Subprocess for the compile-cache tests: get one KV-insert kernel, print the counters."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cute_kernels  # noqa: E402
from cute_kernels.kv_rope_insert import KERNELS, KvRopeInsertKey  # noqa: E402
from cute_kernels.layouts import CacheFormat  # noqa: E402

KERNELS.get(KvRopeInsertKey(CacheFormat(sys.argv[1]), sys.argv[2]))
print(json.dumps(cute_kernels.cache_stats()))
