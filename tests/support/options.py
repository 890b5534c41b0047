"""Options for an engine in the test's own process."""

from __future__ import annotations

from typing import Any

import datadist_aio as dd

MiB = 1 << 20


def make_options(pool_bytes: int = 64 * MiB, **extra: Any) -> dict[str, str]:
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}, "page_shift": 16}}'
    for name, value in extra.items():
        setattr(config, name, value)
    return config.generate_options()

