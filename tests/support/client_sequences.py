"""The llm_datadist call sequences of public clients, as child-process bodies.

Each body is one process of a disaggregated deployment, written from reading
the client's code: the options it sets, the caches it registers, the links
it makes, the transfers and the teardown, in that order. Only what those
clients cannot have on a host without accelerators differs, and is said
where it happens: memory is host memory (``Placement.HOST``), and the table
or the options say where a member listens. Metadata the clients exchange
over ZMQ or HTTP travels over a ``Pipe`` (``chan``) here.

A body returns what the test checks (bytes received, statuses); ``run_all``
starts the bodies with the spawn method, collects the results and makes sure
every process is gone.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

import datadist_aio as dd

__all__ = ["run_all", "vllm_ascend_worker", "mindie_worker", "omni_infer_worker", "kv_tensors", "digest"]

_SPAWN = multiprocessing.get_context("spawn")


# -- harness ------------------------------------------------------------------------


def _body(target: Callable[..., Any], ctl: Any, chan: Any, kwargs: dict[str, Any]) -> None:
    from support.peer import _die_with_parent  # noqa: PLC0415 (the child's own import)

    _die_with_parent()
    import faulthandler  # noqa: PLC0415

    faulthandler.dump_traceback_later(45, exit=False)  # where a hung body is, before the parent kills it
    try:
        ctl.send(("ok", target(chan, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        ctl.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def run_all(bodies: list[tuple[Callable[..., Any], dict[str, Any]]], timeout: float = 60.0) -> list[Any]:
    """Runs two bodies (connected by a duplex Pipe) in spawned processes;
    returns their results in order. Raises if one fails or misses ``timeout``;
    every process is joined or killed before this returns."""
    assert len(bodies) == 2
    chan_a, chan_b = _SPAWN.Pipe()
    procs, ctls = [], []
    try:
        for (target, kwargs), chan in zip(bodies, (chan_a, chan_b)):
            parent, child = _SPAWN.Pipe()
            proc = _SPAWN.Process(target=_body, args=(target, child, chan, kwargs), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            ctls.append(parent)
        results: list[Any] = [None] * len(procs)
        pending = dict(enumerate(ctls))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                raise TimeoutError(f"client sequence still running after {timeout:g} s: processes {sorted(pending)}")
            for index, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, *payload = conn.recv()
                except EOFError:
                    raise RuntimeError(f"process {index} died with code {procs[index].exitcode}") from None
                if status != "ok":
                    raise RuntimeError(f"process {index}: {payload[0]}\n{payload[1]}")
                results[index] = payload[0]
                del pending[index]
        return results
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            proc.close()
        for conn in [chan_a, chan_b, *ctls]:
            conn.close()


# -- memory -------------------------------------------------------------------------


def kv_tensors(num_tensors: int, shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    """Host tensors of float16 standing for device KV tensors, filled from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 15, size=shape, dtype=np.uint16).view(np.float16) for _ in range(num_tensors)]


def digest(tensors: list[np.ndarray], blocks: list[int]) -> str:
    """A hash of the listed blocks (dimension 0) of every tensor."""
    h = hashlib.sha256()
    for t in tensors:
        for b in blocks:
            h.update(t[b].tobytes())
    return h.hexdigest()


def _addrs(tensors: list[np.ndarray]) -> list[int]:
    return [t.ctypes.data for t in tensors]


def _wait_linked(datadist: dd.LLMDataDist, comm_id: int, interval: float, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        ret = datadist.query_register_mem_status(comm_id=comm_id)
        if ret == dd.RegisterMemStatus.OK:
            return
        if ret == dd.RegisterMemStatus.FAILED:
            raise RuntimeError(f"linking failed, comm id {comm_id}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"comm {comm_id} still PREPARING")
        time.sleep(interval)


# -- vllm-ascend: LLMDataDistCMgrConnectorWorker (0.9 to 0.11) ----------------------

NUM_LAYERS = 3
NUM_BLOCKS = 8
BLOCK_SHAPE = (4, 2, 8)  # block_size, heads, head_dim
MLA_SHAPES = ((4, 1, 16), (4, 1, 4))  # k_normed (latent), k_pe


def vllm_ascend_worker(
    chan: Any, *, producer: bool, mla: bool, cluster_id: int, device_ip: str, port: int, super_pod: bool
) -> dict[str, Any]:
    role = dd.LLMRole.PROMPT if producer else dd.LLMRole.DECODER
    datadist = dd.LLMDataDist(role, cluster_id)
    config = dd.LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 5000
    config.enable_switch_role = True
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    # Here: where this member accepts links. Rank tables without device_port
    # expect every member on the same port at its own device_ip.
    config.listen_ip_info = f"{device_ip}:{port}"
    datadist.init(config.generate_options())
    cache_manager = datadist.cache_manager
    metadata = {
        "super_pod_id": "0",
        "server_id": "host-0",
        "device_id": "0" if producer else "1",
        "device_ip": device_ip,
        "super_device_id": "0" if producer else "1",
        "cluster_id": cluster_id,
    }

    # register_kv_caches: one (k, v) or (k_normed, k_pe) tuple per layer.
    seed = 1 if producer else 2
    if mla:
        groups = [kv_tensors(NUM_LAYERS, (NUM_BLOCKS, *shape), seed + 10 * i) for i, shape in enumerate(MLA_SHAPES)]
        caches = []
        for model_id, tensors in enumerate(groups):
            desc = dd.CacheDesc(len(tensors), [*tensors[0].shape], dd.DataType.DT_FLOAT16, placement=dd.Placement.HOST)
            key = dd.BlocksCacheKey(cluster_id=cluster_id, model_id=model_id)
            caches.append(cache_manager.register_blocks_cache(desc, _addrs(tensors), key))
    else:
        flat = kv_tensors(2 * NUM_LAYERS, (NUM_BLOCKS, *BLOCK_SHAPE), seed)
        groups = [flat]
        desc = dd.CacheDesc(len(flat), [*flat[0].shape], dd.DataType.DT_FLOAT16, placement=dd.Placement.HOST)
        caches = [cache_manager.register_blocks_cache(desc, _addrs(flat), dd.BlocksCacheKey(cluster_id=cluster_id))]

    def add_remote_agent(remote: dict[str, Any]) -> int:
        prefill, decode = (metadata, remote) if producer else (remote, metadata)
        same_server = prefill["server_id"] == decode["server_id"]
        comm_name = f"pd_comm_{prefill['device_ip']}_{decode['device_ip']}"
        cluster_rank_info = {prefill["cluster_id"]: 0, decode["cluster_id"]: 1}

        def device(meta: dict[str, Any], rank: str) -> dict[str, str]:
            fields = [("device_id", meta["device_id"]), ("device_ip", meta["device_ip"]),
                      ("super_device_id", meta["super_device_id"]), ("rank_id", rank)]
            return {k: v for k, v in fields if v is not None}

        table: dict[str, Any] = {"version": "1.2", "server_count": "1" if same_server else "2", "status": "completed"}
        servers = [{"device": [device(prefill, "0")], "server_id": prefill["server_id"]}]
        if same_server:
            servers[0]["device"].append(device(decode, "1"))
        else:
            servers.append({"device": [device(decode, "1")], "server_id": decode["server_id"]})
        table["server_list"] = servers
        if super_pod:
            table["super_pod_list"] = [{"super_pod_id": prefill["super_pod_id"],
                                        "server_list": [{"server_id": prefill["server_id"]}]}]
        comm_id = datadist.link(comm_name, cluster_rank_info, json.dumps(table))
        _wait_linked(datadist, comm_id, interval=0.05)
        return comm_id

    result: dict[str, Any] = {"cluster_id": cluster_id}
    if producer:
        # listen_for_agent_metadata_req: answer first, then link.
        event, remote = chan.recv()
        assert event == "ReqForMetadata"
        chan.send(metadata)
        comm_id = add_remote_agent(remote)
        event, finished = chan.recv()  # ReqForFinished: the decoder has read the blocks
        assert event == "ReqForFinished"
        chan.send("receiving decode finished")
        result["sent"] = [digest(tensors, [1, 2, 5]) for tensors in groups]
    else:
        # connect_to_remote_agent, then _read_blocks.
        chan.send(("ReqForMetadata", metadata))
        remote = chan.recv()
        comm_id = add_remote_agent(remote)
        remote_block_ids, local_block_ids = [1, 2, 5], [0, 6, 7]
        remote_cluster_id = remote["cluster_id"]
        if mla:
            for model_id, cache in enumerate(caches):
                key = dd.BlocksCacheKey(cluster_id=remote_cluster_id, model_id=model_id)
                cache_manager.pull_blocks(key, cache, remote_block_ids, local_block_ids)
        else:
            key = dd.BlocksCacheKey(cluster_id=remote_cluster_id)
            cache_manager.pull_blocks(key, caches[0], remote_block_ids, local_block_ids)
        chan.send(("ReqForFinished", ["req-0"]))
        chan.recv()
        result["received"] = [digest(tensors, local_block_ids) for tensors in groups]
    # remove_remote_agent, then the worker's end.
    datadist.unlink(comm_id)
    for cache in caches:
        cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return result


# -- MindIE-LLM: SeparateDeploymentWorker / SeparateDeploymentEngine ----------------


def mindie_worker(
    chan: Any, *, role: str, cluster_id: int, device_ip: str, device_port: int
) -> dict[str, Any]:
    engine_role = {"prefill": dd.LLMRole.PROMPT, "decoder": dd.LLMRole.DECODER, "flex": dd.LLMRole.MIX}[role]
    datadist = dd.LLMDataDist(engine_role, cluster_id)
    config = dd.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.link_total_time = 1080
    config.link_retry_count = 80
    config.sync_kv_timeout = 1 * 1000
    options = config.generate_options()
    options["llm.RdmaServiceLevel"] = str(4)
    options["llm.RdmaTrafficClass"] = str(100)
    datadist.init(options)

    # build + set_npu_cache: K is model 0, V is model 1, each one cache of every layer.
    num_blocks = NUM_BLOCKS
    seed = 3 if role != "decoder" else 4
    npu = {m: kv_tensors(NUM_LAYERS, (num_blocks, *BLOCK_SHAPE), seed + m) for m in (0, 1)}
    caches = {}
    for model_id, tensors in npu.items():
        # Here HOST: MindIE says Placement.DEVICE, for NPU memory.
        desc = dd.CacheDesc(num_tensors=NUM_LAYERS, shape=(num_blocks, *BLOCK_SHAPE),
                            data_type=dd.DataType.DT_FLOAT16, placement=dd.Placement.HOST)
        key = dd.BlocksCacheKey(cluster_id=cluster_id, model_id=model_id)
        caches[model_id] = datadist.cache_manager.register_blocks_cache(desc, _addrs(tensors), key)

    # _try_create_link: rank ids by device ip, the smaller ip is rank 0.
    chan.send({"cluster_id": cluster_id, "device_ip": device_ip, "device_id": "0" if role != "decoder" else "1",
               "port": device_port, "dp": 0 if role != "decoder" else 1})
    remote = chan.recv()
    me = {"cluster_id": cluster_id, "device_ip": device_ip, "device_id": "0" if role != "decoder" else "1",
          "port": device_port, "dp": 0 if role != "decoder" else 1}
    # Same device_ip on one host here: the tie goes by port, as two devices' ips would differ.
    low, high = sorted([me, remote], key=lambda m: (tuple(int(x) for x in m["device_ip"].split(".")), m["port"]))
    cluster_rank_info = {low["cluster_id"]: 0, high["cluster_id"]: 1}

    def device(m: dict[str, Any], rank: int) -> dict[str, Any]:
        # Here: device_port says where the member accepts (it has no listen_ip_info).
        return {"device_id": m["device_id"], "device_ip": m["device_ip"], "rank_id": str(rank), "device_port": m["port"]}

    table = {"server_count": "1", "status": "completed", "version": "1.0",
             "server_list": [{"device": [device(low, 0), device(high, 1)], "server_id": "host-0"}]}
    ip1, ip2 = low["device_ip"], high["device_ip"]
    link_name = f"link{max(ip1, ip2)}:{min(ip1, ip2)}_{min(me['dp'], remote['dp'])}:{max(me['dp'], remote['dp'])}"
    comm_id = datadist.link(link_name, cluster_rank_info, json.dumps(table))
    # _query_mem_status: up to 3 queries 50 ms apart, then requeued.
    while True:
        state = None
        for _ in range(3):
            state = datadist.query_register_mem_status(comm_id)
            if state != dd.RegisterMemStatus.PREPARING:
                break
            time.sleep(0.05)
        if state == dd.RegisterMemStatus.OK:
            break
        assert state != dd.RegisterMemStatus.FAILED, "link failed"

    result: dict[str, Any] = {"role": role}
    src_block_table, dst_block_table = [0, 1, 2, 3], [4, 5, 6, 7]
    # The coordinator routes requests once both report the link (query_link_status).
    chan.send("linked")
    assert chan.recv() == "linked"
    if role == "decoder":
        for model_id in caches:  # pull_kv per model id
            key = dd.BlocksCacheKey(cluster_id=remote["cluster_id"], model_id=model_id)
            datadist.cache_manager.pull_blocks(key, caches[model_id], src_block_table, dst_block_table)
        result["received"] = [digest(npu[m], dst_block_table) for m in (0, 1)]
        chan.send("done")
    else:
        assert chan.recv() == "done"
        result["sent"] = [digest(npu[m], src_block_table) for m in (0, 1)]
    # finalize: unlink_all, then finalize.
    datadist.unlink(comm_id)
    datadist.finalize()
    return result


# -- omni-infer: LLMDataDistManager (rank-table links) ------------------------------

RETRYABLE_CODES = [
    dd.LLMStatusCode.LLM_REPEAT_REQUEST,
    dd.LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
    dd.LLMStatusCode.LLM_PROCESSING_LINK,
    dd.LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
    dd.LLMStatusCode.LLM_TIMEOUT,
    dd.LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    dd.LLMStatusCode.LLM_LINK_BUSY,
]


def omni_infer_worker(
    chan: Any, *, prefill: bool, cluster_id: int, ports: list[int], prefill_cluster_id: int, decode_cluster_id: int
) -> dict[str, Any]:
    role = dd.LLMRole.PROMPT if prefill else dd.LLMRole.DECODER
    datadist = dd.LLMDataDist(role, cluster_id)
    config = dd.LLMConfig()
    config.device_id = 0
    config.enable_switch_role = True
    config.enable_cache_manager = True
    config.sync_kv_timeout = 20000
    config.enable_remote_cache_accessible = True
    datadist.init(config.generate_options())

    # register_memory: MLA-style, two caches (model ids 0 and 1), one tensor per layer each.
    seed = 5 if prefill else 6
    flatten = [kv_tensors(NUM_LAYERS, (NUM_BLOCKS, *shape), seed + 10 * i) for i, shape in enumerate(MLA_SHAPES)]
    registered = []
    for model_id, sub_kv_caches in enumerate(flatten):
        # Here HOST: omni-infer leaves CacheDesc's default placement (DEVICE).
        desc = dd.CacheDesc(num_tensors=len(sub_kv_caches), shape=tuple(sub_kv_caches[0].shape),
                            data_type=dd.DataType.DT_FLOAT16, placement=dd.Placement.HOST)
        key = dd.BlocksCacheKey(datadist.cluster_id, model_id=model_id) if prefill else None
        registered.append(datadist.cache_manager.register_blocks_cache(desc, _addrs(sub_kv_caches), key))

    # register_link: one comm per (prefill, decode) pair; p_dp = d_dp = 0.
    comm_name = f"127.0.0.1-{prefill_cluster_id}-127.0.0.1-{decode_cluster_id}-p0-d0-0"
    cluster_rank_info = {int(k): v for k, v in {prefill_cluster_id: 0, decode_cluster_id: 1}.items()}
    table = {"server_count": "2", "status": "completed", "version": "1.0", "server_list": [
        {"server_id": "p-host", "device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0",
                                            "device_port": ports[0]}]},
        {"server_id": "d-host", "device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "1",
                                            "device_port": ports[1]}]}]}
    comm_id = datadist.link(comm_name, cluster_rank_info, json.dumps(table))
    # check_register_status
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == dd.RegisterMemStatus.OK:
            break
        if ret == dd.RegisterMemStatus.FAILED:
            raise RuntimeError("check kv link status failed")
        time.sleep(0.05)

    result: dict[str, Any] = {}
    src_blocks, tgt_blocks = [2, 3, 4], [5, 6, 7]
    if prefill:
        chan.send("serving")  # register_link returned: requests reach this instance from now on
        assert chan.recv() == "pulled"
        result["sent"] = [digest(t, src_blocks) for t in flatten]
    else:
        assert chan.recv() == "serving"  # a request that the prefill has computed
        retries = 0
        for model_id, kv_cache in enumerate(registered):  # pull_kv
            key = dd.BlocksCacheKey(prompt_cluster_id=prefill_cluster_id, model_id=model_id)
            for _ in range(3):  # _pull_blocks
                try:
                    datadist.cache_manager.pull_blocks(key, kv_cache, src_blocks, tgt_blocks)
                    break
                except dd.LLMException as e:
                    if e.status_code not in RETRYABLE_CODES:
                        raise
                    retries += 1
                    time.sleep(0.1)
            else:
                raise RuntimeError("kv cache pull blocks failed")
        result["received"] = [digest(t, tgt_blocks) for t in flatten]
        result["retries"] = retries
        chan.send("pulled")
    datadist.unlink(comm_id)
    for cache in registered:
        datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return result
