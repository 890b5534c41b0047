"""Numpy views of engine memory never point at freed memory.

Each case runs in a child process, so a use after free shows as a signal
instead of taking the test run down: after `deallocate_cache`, after
`finalize()`, after leaving the `with` block, a view made before still reads
the bytes it had (the view holds the memory); a new view or `tensor_addrs` of
a dead cache raises or is empty; no path ends in a signal.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

PRELUDE = """
import gc
import numpy as np
import datadist_aio as dd

def options():
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.host_mem_pool_cfg = '{"memory_size": 67108864}'
    return config.generate_options()

desc = dd.CacheDesc(2, [8, 1 << 16], dd.DataType.DT_UINT8, dd.Placement.HOST)
"""

CASES = {
    "deallocate": """
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
        datadist.init(options())
        cm = datadist.cache_manager
        cache = cm.allocate_cache(desc)
        view = cache.as_numpy(1)
        view[:] = 7
        cm.deallocate_cache(cache)
        # The pool cannot hand the same memory to a new cache while the view lives.
        other = cm.allocate_cache(desc)
        other.as_numpy(1)[:] = 9
        assert (view == 7).all()
        assert cache.tensor_addrs == []
        try:
            cache.as_numpy(0)
        except dd.LLMException:
            pass
        else:
            raise AssertionError("a view of a deallocated cache was made")
        datadist.finalize()
        assert (view == 7).all()
        view[3] = 1  # still writable, still mapped
    """,
    "finalize": """
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
        datadist.init(options())
        cache = datadist.cache_manager.allocate_blocks_cache(desc)
        views = [cache.as_numpy(t) for t in range(2)]
        for t, view in enumerate(views):
            view[:] = t + 3
        datadist.finalize()
        gc.collect()
        assert all((view == t + 3).all() for t, view in enumerate(views))
        assert cache.tensor_addrs == []
        try:
            cache.as_numpy(0)
        except dd.LLMException:
            pass
        else:
            raise AssertionError("a view of a finalized engine's cache was made")
    """,
    "with_block": """
        with dd.LLMDataDist(dd.LLMRole.PROMPT, 1) as datadist:
            datadist.init(options())
            view = datadist.cache_manager.allocate_cache(desc).as_numpy(0)
            view[:] = 5
        gc.collect()
        assert (view == 5).all() and view.sum() == 5 * view.size
    """,
    "registered": """
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
        datadist.init(options())
        cm = datadist.cache_manager
        cache = cm.register_cache(desc, [np.full(desc.shape, 4, dtype=np.uint8) for _ in range(2)])
        view = cache.as_numpy(1)
        cm.unregister_cache(cache.cache_id)
        del cache
        gc.collect()
        datadist.finalize()
        junk = [np.full(desc.size, 1, dtype=np.uint8) for _ in range(8)]  # reuse freed memory, if any was freed
        assert (view == 4).all()
    """,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_view_made_before_keeps_its_memory(case):
    code = PRELUDE + textwrap.dedent(CASES[case]) + "\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip().endswith("ok")
