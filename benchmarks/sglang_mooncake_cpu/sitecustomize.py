"""For bench_sglang_pd.py only: SGLang's Mooncake sender without ``supports_host_tensor_indices``.

With the flag set, SGLang's prefill stages each chunk's page indices
through pinned memory and a ``torch.cuda.Event``, which needs a GPU. With
it off the sender gets the same page indices as a numpy array, as every
other backend does. Python runs this module at start-up in every process
that has this folder on ``PYTHONPATH``; it sets the flag once SGLang's
Mooncake module has been imported, and changes nothing else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Optional, Sequence

_TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        module.MooncakeKVSender.supports_host_tensor_indices = False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
