"""The vLLM connector's scheduler side and metrics, without vLLM engines.

``SchedulerSide`` and ``stats`` import nothing from vLLM, so these run in
every environment; the tests at the end build the real connector class and
are skipped where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from datadist_aio.integrations.vllm import stats
from datadist_aio.integrations.vllm.metadata import LoadSpec, SaveSpec
from datadist_aio.integrations.vllm.scheduler import ScheduledChunk, SchedulerSide, SideSettings

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


class Status(enum.Enum):
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH_CAPPED = 3
    FINISHED_ABORTED = 4


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: Optional[dict[str, Any]] = None
    status: Status = Status.RUNNING


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


SETTINGS = SideSettings(engine_id="prefill-engine", host="10.0.0.7", port=5710, lease_timeout_s=30.0)


def remote_params(**overrides: Any) -> dict[str, Any]:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [7, 3, 9],
        "remote_engine_id": "prefill-engine",
        "remote_host": "10.0.0.7",
        "remote_port": 5710,
        "remote_request_id": "p-req",
    }
    params.update(overrides)
    return params


# -- prefill side -----------------------------------------------------------------


def test_prefill_finished_holds_blocks_under_a_lease_and_answers_nixl_params() -> None:
    clock = Clock()
    side = SchedulerSide(SETTINGS, clock)
    request = Request("p-req", list(range(100)), {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED)
    held, params = side.request_finished(request, [4, 5, 6, 8])
    assert held is True
    assert params is not None
    token = params.pop("lease_token")
    assert isinstance(token, str) and len(token) == 16 and int(token, 16) >= 0
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [4, 5, 6, 8],
        "remote_engine_id": "prefill-engine",
        "remote_host": "10.0.0.7",
        "remote_port": 5710,
        "remote_request_id": "p-req",
        "tp_size": 1,
    }
    assert side.held == {"p-req"}
    plan = side.build_plan()
    assert plan.leases == {"p-req": 1030.0}
    assert plan.lease_tokens == {"p-req": token}, "the worker side learns the token the decode side will name"
    assert plan.loads == {}
    assert side.build_plan().is_empty(), "the plan hands its state over once"
    side.blocks_freed({"p-req"})
    assert side.held == set()


def test_prefill_accepts_per_group_block_lists() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("r", [1] * 64, {"do_remote_decode": True}, Status.FINISHED_STOPPED)
    held, params = side.request_finished(request, ([2, 3],))
    assert held and params is not None and params["remote_block_ids"] == [2, 3]


@pytest.mark.parametrize("status", [Status.FINISHED_ABORTED, Status.RUNNING])
def test_prefill_aborted_frees_at_once(status: Status) -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("r", [1] * 64, {"do_remote_decode": True}, status)
    assert side.request_finished(request, [1, 2]) == (False, None)
    assert side.build_plan().is_empty()
    assert side.held == set()


def test_prefill_without_blocks_holds_nothing() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("r", [1], {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED)
    held, params = side.request_finished(request, [])
    assert held is False and params is not None and params["remote_block_ids"] == []
    assert side.build_plan().leases == {}


SAVING = SideSettings(engine_id="p", host="127.0.0.1", port=1, plan_saves=True, block_size=4)


def test_decode_first_requests_plan_an_expect_and_name_their_transfer() -> None:
    """Decode side: params naming a prefill and a transfer id, no blocks,
    are loaded asynchronously into the blocks after the local prefix hits.
    Prefill side: the request's saves carry the transfer id, and its params
    go to the worker once it finished."""
    decode = SchedulerSide(SideSettings(engine_id="d", host="127.0.0.1", port=2))
    params = {"do_remote_prefill": True, "transfer_id": "x-1", "remote_host": "10.0.0.2", "remote_port": 7000,
              "tp_size": 2}
    request = Request("d1", list(range(40)), params)
    assert decode.get_num_new_matched_tokens(request, 16) == (24, True)
    decode.update_state_after_alloc(request, [[5, 6]], 24)
    spec = decode.build_plan().loads["d1"]
    assert (spec.transfer_id, spec.local_block_ids, spec.remote_block_ids, spec.first_token) == ("x-1", [5, 6], [], 16)
    assert (spec.remote_host, spec.remote_port, spec.remote_tp_size) == ("10.0.0.2", 7000, 2)
    hybrid = SchedulerSide(SideSettings(engine_id="d", host="127.0.0.1", port=2, window_blocks=(0, 3)))
    request = Request("d2", list(range(40)), dict(params, do_remote_prefill=True))
    hybrid.update_state_after_alloc(request, [[5, 6], [7]], 24)
    spec = hybrid.build_plan().loads["d2"]  # several groups: paired once the prefill names its blocks
    assert (spec.local_block_ids, spec.more_groups, spec.window_blocks, spec.error) == ([5, 6], [([7], [], 0)],
                                                                                        [0, 3], "")
    for bad in ({"transfer_id": "", "remote_host": "h", "remote_port": 1},
                {"transfer_id": "x" * 200, "remote_host": "h", "remote_port": 1},
                {"transfer_id": "x", "remote_host": "h", "remote_port": "1"}):
        assert decode.get_num_new_matched_tokens(Request("d3", [1] * 8, {"do_remote_prefill": True, **bad}), 0) \
            == (0, False), bad

    prefill = SchedulerSide(SAVING, Clock())
    request = Request("p1", list(range(8)), {"do_remote_decode": True, "transfer_id": "x-1"})
    prefill.update_state_after_alloc(request, [], 0)
    plan = prefill.build_plan([ScheduledChunk("p1", [3, 4], True, 0, 8)])
    token = plan.saves["p1"].lease_token
    assert plan.saves == {"p1": SaveSpec("p1", [3, 4], 0, 2, True, "x-1", token)} and len(token) == 16
    request.status = Status.FINISHED_LENGTH_CAPPED
    held, answer = prefill.request_finished(request, [3, 4])
    assert held and answer is not None and answer["lease_token"] == token, "the lease takes the token drawn early"
    assert prefill.build_plan().announce == {"x-1": answer}


def test_a_hybrid_decode_first_request_names_every_groups_blocks_as_its_prompt_ends() -> None:
    """With several KV cache groups the step that ends a decode-first
    prompt names every group's blocks (a sliding-window group's in-window
    tail), as the finished request's params will: a decode that pulls needs
    no later step of the prefill."""
    settings = dataclasses.replace(SAVING, window_blocks=(2, 0))  # group 0: a window of 2 blocks
    prefill = SchedulerSide(settings, Clock())
    request = Request("p1", list(range(18)), {"do_remote_decode": True, "transfer_id": "x-1"})  # 5 blocks of 4
    prefill.update_state_after_alloc(request, [], 0)
    first = prefill.build_plan([ScheduledChunk("p1", [1, 2, 3], True, 0, 10, ([11, 12, 13],))])
    assert first.saves["p1"].all_groups is None, "named as the prompt ends"
    # Each step names each group's blocks it computes, for the push (the
    # partly filled block again with the next step).
    assert first.saves["p1"].block_ids == [1, 2, 3] and first.saves["p1"].more_block_ids == [[11, 12, 13]]
    last = prefill.build_plan([ScheduledChunk("p1", [4, 5], False, 10, 8, ([14, 15],))]).saves["p1"]
    assert last.last and last.all_groups == [[4, 5], [11, 12, 13, 14, 15]]
    assert last.first_index == 2 and last.block_ids == [3, 4, 5] and last.more_block_ids == [[13, 14, 15]]
    request.status = Status.FINISHED_LENGTH_CAPPED
    _held, answer = prefill.request_finished(request, ([1, 2, 3, 4, 5], [11, 12, 13, 14, 15]))
    assert answer is not None and answer["remote_block_ids"] == last.all_groups
    # One group: the blocks of the steps name it (no list per group).
    single = SchedulerSide(SAVING, Clock())
    single.update_state_after_alloc(Request("p2", list(range(8)), {"do_remote_decode": True, "transfer_id": "x-2"}),
                                    [], 0)
    assert single.build_plan([ScheduledChunk("p2", [3, 4], True, 0, 8)]).saves["p2"].all_groups is None


def test_saves_name_the_blocks_each_chunk_writes() -> None:
    side = SchedulerSide(SAVING, Clock())
    request = Request("r", list(range(18)), {"do_remote_decode": True})  # 5 blocks of 4 tokens
    side.update_state_after_alloc(request, [], 0)
    # First chunk: 10 tokens, blocks 0-2 (block 2 half full).
    plan = side.build_plan([ScheduledChunk("r", [7, 8, 9], True, 0, 10), ScheduledChunk("other", [1], True, 0, 4)])
    assert plan.saves == {"r": SaveSpec("r", [7, 8, 9], 0, 5, False)}
    # Second chunk: tokens 10-17; block 2 again, then 3 and 4.
    plan = side.build_plan([ScheduledChunk("r", [3, 5], False, 10, 8)])
    assert plan.saves == {"r": SaveSpec("r", [9, 3, 5], 2, 5, True)}
    # The prompt is done: decoding steps save nothing.
    assert side.build_plan([ScheduledChunk("r", None, False, 18, 1)]).saves == {}


def test_saves_start_with_local_prefix_hits_and_restart_after_preemption() -> None:
    side = SchedulerSide(SAVING, Clock())
    request = Request("r", list(range(16)), {"do_remote_decode": True})
    side.update_state_after_alloc(request, [], 0)
    # 8 tokens were prefix hits on the prefill: their blocks go too.
    plan = side.build_plan([ScheduledChunk("r", [4, 5, 6], True, 8, 4)])
    assert plan.saves["r"] == SaveSpec("r", [4, 5, 6], 0, 4, False)
    # Preempted and resumed with new blocks, recomputed from token 4.
    plan = side.build_plan([ScheduledChunk("r", [1, 2, 3, 9], True, 4, 12)])
    assert plan.saves["r"] == SaveSpec("r", [2, 3, 9], 1, 4, True)


def test_saves_only_where_planned_and_not_after_an_abort() -> None:
    plain = SchedulerSide(SETTINGS, Clock())
    request = Request("r", list(range(8)), {"do_remote_decode": True})
    plain.update_state_after_alloc(request, [], 0)
    assert plain.build_plan([ScheduledChunk("r", [1, 2], True, 0, 8)]).saves == {}
    side = SchedulerSide(SAVING, Clock())
    side.update_state_after_alloc(request, [], 0)
    request.status = Status.FINISHED_ABORTED
    side.request_finished(request, [1, 2])
    assert side.build_plan([ScheduledChunk("r", [1, 2], True, 0, 8)]).saves == {}


def test_plain_request_is_ignored() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("r", [1] * 40, None, Status.FINISHED_LENGTH_CAPPED)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, [1, 2], 0)
    assert side.request_finished(request, [1, 2]) == (False, None)
    assert side.build_plan().is_empty()


# -- decode side --------------------------------------------------------------------


def test_decode_matches_whole_prompt_asynchronously() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("d-req", list(range(70)), remote_params())
    assert side.get_num_new_matched_tokens(request, 0) == (70, True)
    assert side.get_num_new_matched_tokens(request, 32) == (38, True)
    assert side.get_num_new_matched_tokens(request, 70) == (0, False)


@pytest.mark.parametrize("missing", ["remote_block_ids", "remote_engine_id", "remote_host", "remote_port"])
def test_decode_with_incomplete_params_computes_locally(missing: str) -> None:
    side = SchedulerSide(SETTINGS, Clock())
    params = remote_params()
    del params[missing]
    request = Request("d", list(range(70)), params)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, [1, 2, 3], 0)
    assert side.build_plan().loads == {}


def test_decode_plans_one_load_per_request() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("d-req", list(range(70)), remote_params())
    side.update_state_after_alloc(request, [11, 12, 13], 70)
    # A second allocation for the same request (after the load) plans nothing more.
    side.update_state_after_alloc(request, [11, 12, 13, 14], 0)
    plan = side.build_plan()
    assert plan.loads == {
        "d-req": LoadSpec(
            req_id="d-req",
            local_block_ids=[11, 12, 13],
            remote_block_ids=[7, 3, 9],
            remote_engine_id="prefill-engine",
            remote_host="10.0.0.7",
            remote_port=5710,
            remote_request_id="p-req",
            first_token=0,
            remote_tp_size=1,
        )
    }
    assert request.kv_transfer_params is not None and request.kv_transfer_params["do_remote_prefill"] is False
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)


def test_decode_with_local_prefix_hit_reads_only_the_tail() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("d", list(range(100)), remote_params(remote_block_ids=[1, 2, 3, 4]))
    side.update_state_after_alloc(request, [20, 21], 36)
    spec = side.build_plan().loads["d"]
    # 64 tokens were found locally: the worker reads from token 64 on, of
    # the prefill's whole list (its block size may differ).
    assert (spec.local_block_ids, spec.remote_block_ids, spec.first_token) == ([20, 21], [1, 2, 3, 4], 64)


def test_decode_full_local_hit_only_releases_the_prefill() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("d", list(range(64)), remote_params())
    side.update_state_after_alloc(request, [], 0)
    spec = side.build_plan().loads["d"]
    assert spec.local_block_ids == [] and spec.remote_block_ids == []
    assert spec.remote_request_id == "p-req"


def test_decode_aborted_before_scheduling_releases_the_prefill() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    request = Request("d", list(range(64)), remote_params(), Status.FINISHED_ABORTED)
    assert side.request_finished(request, []) == (False, None)
    spec = side.build_plan().loads["d"]
    assert spec.local_block_ids == [] and spec.remote_request_id == "p-req"


def test_remote_request_id_defaults_to_the_local_one() -> None:
    side = SchedulerSide(SETTINGS, Clock())
    params = remote_params()
    del params["remote_request_id"]
    side.update_state_after_alloc(Request("same-id", list(range(64)), params), [5, 6, 7], 64)
    assert side.build_plan().loads["same-id"].remote_request_id == "same-id"


# -- stats ----------------------------------------------------------------------------


def test_stats_record_merge_reduce() -> None:
    a, b = stats.empty(), stats.empty()
    assert stats.is_empty(a)
    stats.record(a, stats.TransferRecord(0.002, 4096, 2, True))
    stats.record(b, stats.TransferRecord(0.004, 8192, 4, True))
    stats.record(b, stats.TransferRecord(1.0, 0, 4, False))
    stats.add_answers(a, 3, 1)
    stats.add_answers(b, 2, 0)
    merged = stats.merge(a, b)
    assert merged["transfer_duration"] == [0.002, 0.004]
    assert merged["bytes_transferred"] == [4096, 8192]
    assert merged["num_successful_transfers"] == 2 and merged["num_failed_transfers"] == 1
    assert merged["answers_read"] == 5 and merged["answers_read_by_sweep"] == 1
    summary = stats.reduce(merged)
    assert summary["median_xfer_time_ms"] == 3.0
    assert summary["num_failed_transfers"] == 1
    assert summary["answers_read"] == 5 and summary["answers_read_by_sweep"] == 1
    assert not stats.is_empty(merged)
    only_answers = stats.empty()
    stats.add_answers(only_answers, 4, 0)
    assert not stats.is_empty(only_answers), "answers read are reported even without a load"
    pushes = stats.empty()
    stats.record_push(pushes, stats.PushStep(overlapped=True, aborted=False, tail_seconds=0.004))
    stats.record_push(pushes, stats.PushStep(overlapped=False, aborted=True, tail_seconds=0.001))
    assert not stats.is_empty(pushes), "pushed steps are reported even without a load"
    pushes = stats.merge(pushes, merged)
    assert (pushes["push_steps"], pushes["push_steps_overlapped"], pushes["push_steps_aborted"]) == (2, 1, 1)
    assert pushes["push_tail_duration"] == [0.004, 0.001]
    assert stats.reduce(pushes)["push_steps_overlapped"] == 1


def test_answer_counter_reports_increases() -> None:
    counter = stats.AnswerCounter()
    assert counter.delta({}) == (0, 0)
    assert counter.delta({"drain": 2, "sweep": 1}) == (3, 1)
    assert counter.delta({"drain": 2, "sweep": 1}) == (0, 0)
    assert counter.delta({"drain": 2, "look": 5, "sweep": 1}) == (5, 0), "a new reader kind counts from zero"
    assert counter.delta({"drain": 4, "look": 5, "sweep": 3, "link": 1}) == (5, 2)


# -- the real connector class (needs vLLM) -----------------------------------------------


def needs_vllm(test: Any) -> Any:
    return pytest.mark.vllm_venv(pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")(test))


@needs_vllm
def test_connector_stats_and_prometheus_metrics() -> None:
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram

    from datadist_aio.integrations.vllm import DatadistAioConnector

    data = stats.empty()
    stats.record(data, stats.TransferRecord(0.003, 1 << 20, 8, True, seen_seconds=0.021, setup_seconds=0.007))
    stats.record(data, stats.TransferRecord(2.0, 0, 8, False, seen_seconds=2.0))
    stats.add_answers(data, 6, 1)
    stats.record_push(data, stats.PushStep(overlapped=True, aborted=False, tail_seconds=0.002))
    stats.record_push(data, stats.PushStep(overlapped=False, aborted=True, tail_seconds=0.001))
    built = DatadistAioConnector.build_kv_connector_stats(data)
    assert built is not None and not built.is_empty()
    assert built.reduce()["num_failed_transfers"] == 1
    other = DatadistAioConnector.build_kv_connector_stats(data)
    assert other is not None
    assert built.aggregate(other).data["num_successful_transfers"] == 2

    registry = prometheus_client.CollectorRegistry()

    def bound(kind: Any) -> Any:
        class Bound(kind):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    class Config:
        kv_transfer_config = None

    metric_types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    prom = DatadistAioConnector.build_prom_metrics(Config(), metric_types, ["engine"], {0: ["0"]})
    assert prom is not None
    prom.observe(built.data, 0)
    sample = registry.get_sample_value
    assert sample("vllm:datadist_aio_xfer_time_seconds_count", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_xfer_time_seconds_sum", {"engine": "0"}) == pytest.approx(0.006)
    # The time until vLLM saw each load is a histogram of its own (successes only, as the transfer's).
    assert sample("vllm:datadist_aio_load_seen_seconds_count", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_load_seen_seconds_sum", {"engine": "0"}) == pytest.approx(0.042)
    # So is the time before the reads were posted (a first contact).
    assert sample("vllm:datadist_aio_load_setup_seconds_count", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_load_setup_seconds_sum", {"engine": "0"}) == pytest.approx(0.014)
    assert sample("vllm:datadist_aio_bytes_transferred_sum", {"engine": "0"}) == 2 * (1 << 20)
    assert sample("vllm:datadist_aio_num_transfers_total", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_num_failed_transfers_total", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_answers_read_total", {"engine": "0"}) == 12
    assert sample("vllm:datadist_aio_answers_read_by_sweep_total", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_push_steps_total", {"engine": "0"}) == 4
    assert sample("vllm:datadist_aio_push_steps_overlapped_total", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_push_steps_aborted_total", {"engine": "0"}) == 2
    assert sample("vllm:datadist_aio_push_tail_seconds_sum", {"engine": "0"}) == pytest.approx(0.006)


@dataclass
class _Blocks:
    ids: list[int] = field(default_factory=list)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [self.ids]  # vLLM's KVCacheBlocks of one KV cache group


@needs_vllm
def test_connector_scheduler_role_end_to_end_of_one_request() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from datadist_aio.integrations.vllm import DatadistAioConnector, DatadistAioConnectorMetadata

    class Config:
        kv_transfer_config = KVTransferConfig(
            kv_connector="DatadistAioConnector",
            kv_connector_module_path="datadist_aio.integrations.vllm",
            kv_role="kv_both",
            engine_id="engine-a",
            kv_connector_extra_config={"side_channel_port": 6123, "side_channel_host": "127.0.0.1"},
        )

        class parallel_config:  # noqa: N801
            tensor_parallel_size = 1

        class cache_config:  # noqa: N801
            block_size = 16

    connector = DatadistAioConnector(Config(), KVConnectorRole.SCHEDULER, None)
    prefill = Request("p1", list(range(80)), {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED)
    held, params = connector.request_finished(prefill, [3, 4, 5])
    assert held and params is not None
    assert (params["remote_host"], params["remote_port"], params["remote_engine_id"]) == ("127.0.0.1", 6123, "engine-a")
    assert connector.has_pending_block_frees()

    decode = Request("d1", list(range(80)), dict(params))
    assert connector.get_num_new_matched_tokens(decode, 0) == (80, True)
    connector.update_state_after_alloc(decode, _Blocks([9, 8, 7]), 80)
    idle = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                 num_computed_tokens=[]))
    meta = connector.build_connector_meta(idle)
    assert isinstance(meta, DatadistAioConnectorMetadata)
    assert meta.plan.loads["d1"].remote_block_ids == [3, 4, 5]
    assert meta.plan.loads["d1"].local_block_ids == [9, 8, 7]
    assert "p1" in meta.plan.leases

    class Output:
        finished_sending = {"p1"}

    connector.update_connector_output(Output())
    assert not connector.has_pending_block_frees()


@needs_vllm
@pytest.mark.parametrize("buffer, role, planned", [("cuda", "kv_producer", True), ("cpu", "kv_producer", True),
                                                   ("cuda", "kv_consumer", False)])
def test_every_prefill_plans_its_saves(monkeypatch: pytest.MonkeyPatch, buffer: str, role: str,
                                       planned: bool) -> None:
    """A prefill plans the blocks each step writes whatever its buffer: a
    decode-first request is pushed in any mode (the host buffer also copies
    them out). A decode plans none."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from datadist_aio.integrations.vllm import connector as module

    monkeypatch.setattr(module, "_on_device", lambda: True)

    class Config:
        kv_transfer_config = KVTransferConfig(
            kv_connector="DatadistAioConnector",
            kv_connector_module_path="datadist_aio.integrations.vllm",
            kv_role=role,
            engine_id="engine-a",
            kv_buffer_device=buffer,
            kv_connector_extra_config={"side_channel_port": 6123},
        )

        class parallel_config:  # noqa: N801
            tensor_parallel_size = 1

        class cache_config:  # noqa: N801
            block_size = 16

    connector = module.DatadistAioConnector(Config(), KVConnectorRole.SCHEDULER, None)
    assert connector._plan_saves is planned
    assert connector.scheduler_side is not None and connector.scheduler_side.settings.plan_saves is planned


@pytest.mark.parametrize("given, taken", [(2, 2), (8, 8), (None, 1), ("2", 1), (0, 1), (True, 1)])
def test_decode_learns_the_prefill_tp_size_from_its_params(given: Any, taken: int) -> None:
    side = SchedulerSide(SETTINGS, Clock())
    params = remote_params() if given is None else remote_params(tp_size=given)
    side.update_state_after_alloc(Request("d", list(range(70)), params), [11, 12, 13], 70)
    assert side.build_plan().loads["d"].remote_tp_size == taken


@needs_vllm
def test_sleep_mode_is_refused_naming_the_connector() -> None:
    """vLLM 0.33 asks ``supports_sleep_mode`` when it checks its config and
    refuses ``--enable-sleep-mode``; vLLM 0.32 does not ask, so the
    connector's constructor refuses it, naming itself."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    from datadist_aio.integrations.vllm import DatadistAioConnector

    transfer = KVTransferConfig(kv_connector="DatadistAioConnector",
                                kv_connector_module_path="datadist_aio.integrations.vllm", kv_role="kv_producer")
    assert DatadistAioConnector.supports_sleep_mode(transfer) is False
    sleeping = SimpleNamespace(kv_transfer_config=transfer, model_config=SimpleNamespace(enable_sleep_mode=True),
                               parallel_config=SimpleNamespace(tensor_parallel_size=1))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="DatadistAioConnector does not support sleep mode"):
            DatadistAioConnector(sleeping, role, None)  # type: ignore[arg-type]
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):  # vLLM 0.33 and later: its own check names us
        with pytest.raises(ValueError, match="DatadistAioConnector does not support sleep mode"):
            VllmConfig._verify_kv_transfer_compat(sleeping)  # type: ignore[arg-type]


@needs_vllm
def test_the_push_asks_vllm_for_piecewise_cuda_graphs() -> None:
    """A full CUDA graph's replay skips save_kv_layer, which paces the push."""
    from datadist_aio.integrations.vllm import DatadistAioConnector

    assert DatadistAioConnector.requires_piecewise_for_cudagraph({"transfer_mode": "push_layerwise"})
    assert not DatadistAioConnector.requires_piecewise_for_cudagraph({"transfer_mode": "pull"})
    assert not DatadistAioConnector.requires_piecewise_for_cudagraph({})
