"""Code written for llm_datadist runs: the call sequences of public clients
(vllm-ascend, MindIE-LLM, omni-infer; xLLM's C++ one is a ctest) between real
processes on loopback, bytes checked at the end."""

from __future__ import annotations

import pytest

from support.client_sequences import mindie_worker, omni_infer_worker, run_all, vllm_ascend_worker
from support.peer import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
def test_vllm_ascend_llmdatadist_c_mgr_connector(mla):
    # Prefill on 127.0.0.1, decode on 127.0.0.2, one port: the rank table as
    # the connector builds it, with no port in it.
    port = free_port()
    common = {"mla": mla, "port": port, "super_pod": mla}
    prefill, decode = run_all([
        (vllm_ascend_worker, {"producer": True, "cluster_id": 100, "device_ip": "127.0.0.1", **common}),
        (vllm_ascend_worker, {"producer": False, "cluster_id": 200, "device_ip": "127.0.0.2", **common}),
    ])
    assert decode["received"] == prefill["sent"]


def test_mindie_separate_deployment_engine():
    flex, decoder = run_all([
        (mindie_worker, {"role": "flex", "cluster_id": 7, "device_ip": "127.0.0.1", "device_port": free_port()}),
        (mindie_worker, {"role": "decoder", "cluster_id": 8, "device_ip": "127.0.0.1", "device_port": free_port()}),
    ])
    assert decoder["received"] == flex["sent"]


def test_omni_infer_llmdatadist_manager():
    ports = [free_port(), free_port()]
    ids = {"prefill_cluster_id": 1000, "decode_cluster_id": 2000}
    prefill, decode = run_all([
        (omni_infer_worker, {"prefill": True, "cluster_id": 1000, "ports": ports, **ids}),
        (omni_infer_worker, {"prefill": False, "cluster_id": 2000, "ports": ports, **ids}),
    ])
    assert decode["received"] == prefill["sent"]
