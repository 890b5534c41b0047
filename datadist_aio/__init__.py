"""datadist_aio: asyncio-native KV-cache transfer with the LLM-DataDist v2 API.

Code written for ``llm_datadist`` runs after changing the import; every
data-moving call also has an ``_async`` form returning an awaitable
``CacheTask``.
"""

import importlib.util as _importlib_util
import os as _os

if _importlib_util.find_spec(__name__ + "._native") is None:
    # A source tree's datadist_aio/ on sys.path (its root as the current
    # directory) shadows the installed package and holds no built engine.
    raise ImportError(
        f"datadist_aio's native extension (_native) is not built in {_os.path.dirname(__file__)}: this is a source "
        "tree without its build, imported in place of an installed datadist_aio. Install it editable from that "
        "tree (pip install -e .), or run from another directory so that the installed package is imported.",
        name=__name__ + "._native",
    )

from .cache import Cache
from .cache_desc import CacheDesc
from .cache_key import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from .cache_manager import CacheManager
from .cache_task import CacheTask
from .cluster_info import LLMClusterInfo
from .config import LlmConfig, LLMConfig
from .cuda_event_synchronizer import CudaEventSynchronizer
from .data_type import DataType
from .enums import LLMRole, Memtype, Placement, RegisterMemStatus
from .layer_synchronizer import LayerGate, LayerSynchronizer
from .llm_datadist import LLMDataDist
from .mem_info import MemInfo
from .status import LLMException, LLMStatusCode, Status
from .transfer_config import TransferConfig, TransferWithCacheKeyConfig

__version__ = "0.1.0"

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "CudaEventSynchronizer",
    "DataType",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerGate",
    "LayerSynchronizer",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]
