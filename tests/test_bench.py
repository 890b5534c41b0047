"""The benchmark command: its workload, its byte checks, its sessions on
loopback and through a separate serve process, and its report files."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import multiprocessing as mp
import multiprocessing.resource_tracker
from multiprocessing.connection import Client

import numpy as np
import pytest

from datadist_aio import LLMConfig, LLMException
from datadist_aio.bench.__main__ import byte_size, main
from datadist_aio.bench.engines.base import PUSH, label
from datadist_aio.bench.layout import Layout, aligned_tensors, digest, fill
from datadist_aio.bench.progress import Progress
from datadist_aio.bench.runner import Options, Outcome, plans, run_plan
from datadist_aio.bench.session import Plan, start_local_server, stop_local_server

KiB, MiB = 1 << 10, 1 << 20
# Spawning starts multiprocessing's resource tracker once per process, with a
# descriptor kept open; start it before the per-test descriptor check counts.
multiprocessing.resource_tracker.ensure_running()

SMALL = ["--cache-size", "4M", "--block-sizes", "16K,1M", "--layers", "2", "--iterations", "1",
         "--latency-ops", "20", "--streams", "1,2", "--idle", "0.2"]


def test_layout_of_a_cache():
    layout = Layout.for_cache(256 * MiB, 16 * KiB, layers=4)
    assert (layout.tensors, layout.blocks, layout.block_size) == (8, 2048, 16 * KiB)
    assert layout.total_bytes == 256 * MiB
    assert sorted(layout.table()) == list(range(2048))
    assert layout.table() != list(range(2048))
    assert layout.table() == Layout.for_cache(256 * MiB, 16 * KiB, layers=4).table()
    with pytest.raises(ValueError, match="no room"):
        Layout.for_cache(1 * MiB, 4 * MiB, layers=1)


def test_digest_sees_a_swapped_block_and_a_flipped_byte():
    layout = Layout(2, 8, 4 * KiB)
    _, tensors = aligned_tensors(layout)
    assert all(t.ctypes.data % 4096 == 0 for t in tensors)
    fill(tensors, 7)
    order = layout.table()
    before = digest(tensors, order)
    assert digest(tensors, order[1:2] + order[:1] + order[2:]) != before
    tensors[1][order[3], 100] ^= 1
    assert digest(tensors, order) != before


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("16K", 16 * KiB), ("256KiB", 256 * KiB),
                                             ("4M", 4 * MiB), ("1g", 1 << 30)])
def test_sizes(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("argv", [["--block-sizes", "3X"], ["--cache-size", "0"], ["--cache-size", "1K"],
                                  ["--ops", "push,fly"], ["--compare", "rdma"], ["--peer", "nowhere"],
                                  ["--cache-size", "3M", "--streams", "2"], ["--latency-ops", "-1"],
                                  ["--idle", "-1"], ["--ucx", "--ucx-tls", "rdma"],
                                  ["--ucx", "--compare", "nixl"], ["--ucx", "--transport", "tcp"]])
def test_bad_arguments_exit_2(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--output", str(tmp_path)])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
    assert not (tmp_path / "datadist_bench.json").exists()


def test_plans_put_baselines_first():
    options = Options(cache_bytes=32 * MiB, loops=["asyncio"], compare=["mooncake", "nixl"], streams=[1, 4])
    got = plans(options)
    assert [p.label for p in got[:6]] == ["raw_tcp (streams=1)", "raw_tcp (streams=4)",
                                          "raw_tcp (streams=1, busy_poll)", "raw_tcp (streams=1, unix)",
                                          "datadist_aio (loop=asyncio)", "datadist_aio (loop=asyncio, transport=tcp)"]
    assert [p.latency_ops > 0 for p in got[:4]] == [True, False, True, True]
    # The busy-polling and the Unix-socket round trips: latency only.
    assert all(p.layouts == [] and p.ops == [] for p in got[2:4])
    assert [p.engine for p in got[6:]] == ["mooncake"] + ["nixl"] * 4
    assert label("nixl", {"tls": "tcp", "progress_thread": False}) == "nixl (tls=tcp, no progress_thread)"


def test_ucx_plans_pair_each_tls():
    options = Options(cache_bytes=4 * MiB, block_sizes=[16 * KiB], loops=["asyncio"], streams=[1],
                      ucx_tls=["tcp", "shm"], compare=["mooncake"])
    got = [p.label for p in plans(options)]
    assert got == ["raw_tcp (streams=1)", "raw_tcp (streams=1, busy_poll)", "raw_tcp (streams=1, unix)",
                   "datadist_aio (loop=asyncio, transport=ucx, ucx_tls=tcp)",
                   "nixl (tls=tcp, no progress_thread, no target_progress_thread)",
                   "datadist_aio (loop=asyncio, transport=ucx, ucx_tls=shm)",
                   "nixl (tls=shm, no progress_thread, no target_progress_thread)"]
    with pytest.raises(ValueError, match="ucx tls must be"):
        plans(Options(ucx_tls=["rdma"]))


def _run(argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datadist_aio.bench", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_a_run_writes_checked_figures_and_a_plot(tmp_path):
    done = _run([*SMALL, "--output", str(tmp_path)])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "datadist_bench.json").read_text())
    rows = {(r["label"], r["op"], r["block_size"]): r for r in report["results"]}
    ours = [f"datadist_aio (loop={loop}{transport})" for loop in ["asyncio", "uvloop"] for transport in ["", ", transport=tcp"]]
    for name in ours:
        for op in ("push", "pull", "layerwise"):
            for block in (16 * KiB, MiB):
                row = rows[(name, op, block)]
                assert row["verified"] and row["bytes"] == 4 * MiB and len(row["seconds"]) == 1
                assert row["gbps"] > 0 and row["ratio_raw_tcp"] > 0 and row["ratio_memcpy"] > 0
    assert [r["streams"] for r in report["baselines"]["raw_tcp"]] == [1, 2]
    assert report["baselines"]["raw_tcp_best_gbps"] == max(r["gbps"] for r in report["baselines"]["raw_tcp"])
    assert report["baselines"]["memcpy"]["gbps"] > 0
    latency = {lat["label"]: lat for lat in report["latency"]}
    assert set(latency) == {"raw_tcp (streams=1)", "raw_tcp (streams=1, busy_poll)", "raw_tcp (streams=1, unix)", *ours}
    assert all(lat["verified"] and len(lat["samples_us"]) == 20 for lat in latency.values())
    # Costs of both processes per write, ratios to both raw round trips, the submit call and its parts.
    assert all(lat["voluntary_switches_per_op"] >= 0 and lat["cpu_us_per_op"] > 0 for lat in latency.values())
    assert latency["raw_tcp (streams=1)"]["ratio_raw_tcp"] == pytest.approx(1.0)
    assert latency["raw_tcp (streams=1, busy_poll)"]["ratio_busy_poll"] == pytest.approx(1.0)
    assert latency["raw_tcp (streams=1, unix)"]["ratio_raw_unix"] == pytest.approx(1.0)
    for loop in ["asyncio", "uvloop"]:
        lat = latency[f"datadist_aio (loop={loop})"]
        assert lat["ratio_raw_tcp"] > 0 and lat["ratio_busy_poll"] > 0 and lat["ratio_raw_unix"] > 0
        assert 0 < lat["submit_median_us"] < lat["median_us"]
        assert set(lat["submit_parts_us"]) == {"checks_us", "task_us", "native_submit_us"}
        assert lat["submit_parts_us"]["task_us"] > 0 and lat["submit_parts_us"]["native_submit_us"] > 0
    assert "vcsw/op" in done.stdout and "argument checks" in done.stdout
    assert report["machine"]["usable_cpus"] >= 1 and report["versions"]["numpy"] == np.__version__
    idle = {i["label"]: i for i in report["idle_cpu"]}
    assert set(idle) == set(ours)
    assert all(i["seconds"] == 0.2 and 0 <= i["initiator_percent"] and 0 <= i["target_percent"] for i in idle.values())
    assert report["errors"] == [] and report["skipped"] == []
    assert (tmp_path / "datadist_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"^datadist_aio \(loop=asyncio\) +push ", done.stdout, re.M)
    assert re.search(r"^datadist_aio \(loop=asyncio, transport=tcp\) +push ", done.stdout, re.M)


def _collect(plan: Plan, address, key: bytes) -> Outcome:
    outcome = Outcome()
    run_plan(plan, address, key, Progress(1, stream=io.StringIO()), 120, outcome)
    return outcome


def test_unavailable_engine_is_skipped_with_its_reason():
    key = os.urandom(8)
    server, address = start_local_server("127.0.0.1", key)
    try:
        plan = Plan("datadist_aio", {"loop": "trio"}, [Layout(2, 4, 4 * KiB)], [PUSH], 1)
        outcome = _collect(plan, address, key)
    finally:
        stop_local_server(server)
    assert outcome.results == [] and outcome.errors == []
    assert outcome.skipped == [{"label": "datadist_aio (loop=trio)", "reason": "unknown event loop 'trio'"}]


def test_server_turns_away_a_wrong_key_and_keeps_serving():
    key = os.urandom(8)
    server, address = start_local_server("127.0.0.1", key)
    try:
        with pytest.raises(mp.AuthenticationError):
            Client(address, authkey=b"not the key")
        plan = Plan("raw_tcp", {"streams": 2}, [Layout(1, 1, 2 * MiB)], [PUSH], 2)
        outcome = _collect(plan, address, key)
    finally:
        stop_local_server(server)
    assert outcome.errors == [] and len(outcome.results) == 1
    result = outcome.results[0]
    assert result.verified and len(result.seconds) == 2 and result.bytes == 2 * MiB


def test_a_failing_session_is_reported_not_hung():
    """A session whose transfer raises reports the error with its traceback and ends."""
    key = os.urandom(8)
    server, address = start_local_server("127.0.0.1", key)
    try:
        # Three tensors do not split into layers of two: the layer-wise config is refused.
        plan = Plan("datadist_aio", {"loop": "asyncio"}, [Layout(3, 4, 4 * KiB)], ["layerwise"], 1)
        outcome = _collect(plan, address, key)
    finally:
        stop_local_server(server)
    assert outcome.results == [] and len(outcome.errors) == 1
    assert "LLMException: src_cache has an odd tensor count 3 [LLM_PARAM_INVALID]" in outcome.errors[0]["error"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_against_a_serve_process(tmp_path):
    port = _free_port()
    env = {**os.environ, "DATADIST_BENCH_AUTHKEY": "sesame"}
    server = subprocess.Popen([sys.executable, "-m", "datadist_aio.bench", "serve", "--listen", f"127.0.0.1:{port}"],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert f"serving on 127.0.0.1:{port}" in server.stdout.readline()
        done = _run(["--peer", f"127.0.0.1:{port}", "--authkey", "sesame", "--loop", "asyncio", "--transport", "auto", "--ops", "push",
                     "--no-plot", *SMALL, "--output", str(tmp_path)])
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads((tmp_path / "datadist_bench.json").read_text())
        assert report["workload"]["peer"] == f"127.0.0.1:{port}"
        assert all(r["verified"] for r in report["results"]) and len(report["results"]) == 2 + 2
        assert not (tmp_path / "datadist_bench.png").exists()
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        server.stdout.close()


def test_an_unreachable_peer_is_named_before_any_measurement(tmp_path, capsys):
    port = _free_port()
    assert main(["--peer", f"127.0.0.1:{port}", "--authkey", "k", "--output", str(tmp_path)]) == 1
    assert f"no benchmark server at 127.0.0.1:{port}" in capsys.readouterr().err
    assert not (tmp_path / "datadist_bench.json").exists()


def test_a_wrong_key_is_named(tmp_path, capsys):
    server, address = start_local_server("127.0.0.1", b"right")
    try:
        assert main(["--peer", f"{address[0]}:{address[1]}", "--authkey", "wrong", "--output", str(tmp_path)]) == 1
    finally:
        stop_local_server(server)
    assert "refused the key" in capsys.readouterr().err


def test_peer_needs_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("DATADIST_BENCH_AUTHKEY", raising=False)
    with pytest.raises(SystemExit, match="authkey"):
        main(["--peer", "127.0.0.1:1", "--output", str(tmp_path)])


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("mooncake", marks=pytest.mark.skipif(
            importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine is not installed")),
        pytest.param("nixl", marks=[pytest.mark.slow, pytest.mark.skipif(
            importlib.util.find_spec("nixl") is None, reason="nixl is not installed")]),
    ],
)
def test_compared_engines_move_checked_bytes(engine, tmp_path):
    """Where installed, the other engines run the same workload and pass the same byte checks."""
    done = _run([*SMALL, "--compare", engine, "--loop", "asyncio", "--streams", "1", "--no-plot",
                 "--output", str(tmp_path)])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "datadist_bench.json").read_text())
    theirs = [r for r in report["results"] if r["engine"] == engine]
    variants = 4 if engine == "nixl" else 1
    assert len(theirs) == variants * 2 * 2  # push and pull, two block sizes
    assert all(r["verified"] and r["gbps"] > 0 for r in theirs)
    latency = [lat for lat in report["latency"] if lat["engine"] == engine]
    assert len(latency) == variants and all(lat["verified"] for lat in latency)
    assert report["errors"] == [] and report["skipped"] == []


def test_the_ucx_comparison_says_what_ran_and_why_not(tmp_path):
    """``--ucx`` on tiny sizes with whatever is installed: each side of each
    UCX_TLS either moved checked bytes or is reported as not run, with why."""
    done = _run(["--ucx", "--cache-size", "1M", "--block-sizes", "16K,256K", "--layers", "1", "--iterations", "1",
                 "--latency-ops", "20", "--idle", "0", "--no-plot", "--output", str(tmp_path)], timeout=120)
    report = json.loads((tmp_path / "datadist_bench.json").read_text())
    comparison = {entry["tls"]: entry for entry in report["ucx_comparison"]}
    assert [(tls, entry["ucx_tls"]) for tls, entry in comparison.items()] == [("tcp", "tcp"), ("shm", "shm,self,tcp")]
    nixl_installed = importlib.util.find_spec("nixl") is not None
    try:
        LLMConfig().transport = "ucx"
        refused = None
    except LLMException as exc:
        refused = str(exc)
    for tls, entry in comparison.items():
        ours = entry["engines"][f"datadist_aio (loop=asyncio, transport=ucx, ucx_tls={tls})"]
        theirs = entry["engines"][f"nixl (tls={tls}, no progress_thread, no target_progress_thread)"]
        assert theirs["ran"] is nixl_installed
        for side in (ours, theirs):
            if side["ran"]:
                assert side["verified"] and side["reason"] is None
            else:
                assert not side["verified"] and side["reason"]
        if not nixl_installed:
            assert theirs["reason"].startswith("nixl is not installed")
        if refused is not None:  # this library has no UCX data plane: skipped, in its own words
            assert ours["reason"] == f"this datadist_aio refuses transport 'ucx': {refused}"
        elif not ours["ran"]:  # UCX cannot be loaded here
            assert "ucx" in ours["reason"].lower()
        assert len(entry["throughput"]) == (4 if ours["ran"] or theirs["ran"] else 0)  # push, pull; two sizes
        for row in entry["throughput"]:
            assert row["verified"]
            assert (row["ours_gbps"] is not None) is ours["ran"] and (row["theirs_gbps"] is not None) is theirs["ran"]
            assert (row["ratio"] is not None) is (ours["ran"] and theirs["ran"])
        ran = [name for name, side in entry["engines"].items() if side["ran"]]
        assert sorted(entry["latency"]) == sorted(ran)
        for lat in entry["latency"].values():
            assert lat["verified"] and set(lat["wakeups_per_op"]) == {"initiator", "target"}
    # The wake-ups of each process: a blocking round trip wakes each side at least once per write.
    baseline = next(lat for lat in report["latency"] if lat["label"] == "raw_tcp (streams=1)")
    assert baseline["wakeups_per_op"]["initiator"] >= 1 and baseline["wakeups_per_op"]["target"] >= 1
    failed = {error["label"] for error in report["errors"]}
    assert failed <= ({f"datadist_aio (loop=asyncio, transport=ucx, ucx_tls={tls})" for tls in comparison}
                      if refused is None else set())
    assert done.returncode == (1 if failed else 0), done.stdout + done.stderr
    assert "UCX_TLS=shm,self,tcp (shm)" in done.stdout


# -- the device benchmark, on the CUDA driver stand-in -----------------------------------------------


def test_the_device_benchmark_runs_on_the_driver_standin(tmp_path):
    """A smoke run of ``--device`` without a GPU: every batch checked, the
    driver named, and the path of each measurement taken from link_stats
    (figures not compared: the stand-in copies host memory)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    from cuda_standin.build import build

    driver = build(tmp_path / "standin")
    done = _run(["--device", "--driver", str(driver), "--cache-size", "2M", "--block-sizes", "256K,1M",
                 "--iterations", "2", "--output", str(tmp_path)], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "driver: the CUDA driver stand-in" in done.stdout
    report = json.loads((tmp_path / "datadist_bench_device.json").read_text())
    assert report["driver"]["standin"] and report["driver"]["library"] == str(driver)
    assert report["baseline"]["verified"] and report["baseline"]["kind"].startswith("cuMemcpyDtoD")
    assert [r["block_size"] for r in report["results"]] == [256 * KiB, MiB]
    # The driver's own copies, in one process and from memory opened by CUDA IPC in another, each checked.
    copies = report["driver_copies"]
    assert [(r["streams"], "IPC" in r["kind"]) for r in copies] == [(1, False), (16, False), (1, True), (16, True)]
    assert all(r["verified"] and r["bytes"] == 2 * MiB for r in copies), copies
    for row in report["results"]:
        d2d, served, dev, host = row["d2d"], row["d2d_owner"], row["tcp_device"], row["tcp_host"]
        assert all(r["verified"] and len(r["seconds"]) == 2 and r["gbps"] > 0 for r in (d2d, served, dev, host)), row
        # One-sided: every byte copied by the initiator's streams, no frame, the target serving nothing.
        assert (d2d["link"], d2d["path"]) == ("same_host", "one_sided"), d2d
        assert d2d["link_stats"]["one_sided_device_bytes"] == 3 * 2 * MiB, d2d  # the untimed batch and two timed
        assert d2d["link_stats"]["framed_ops"] == d2d["link_stats"]["target_owner_served_ops"] == 0, d2d
        assert (served["link"], served["path"]) == ("same_host", "cuda_ipc"), served
        assert served["link_stats"]["target_ipc_bytes_served"] == 3 * 2 * MiB, served
        assert (dev["link"], dev["path"], host["path"]) == ("tcp", "staged", "host memory"), row
        assert row["ratio_d2d_copy"] > 0 and row["ratio_d2d_owner_copy"] > 0 and row["ratio_tcp_device_host"] > 0


@pytest.mark.parametrize("argv", [["--cache-size", "3M", "--block-sizes", "1M"], ["--block-sizes", "3X"],
                                  ["--iterations", "0"]])
def test_bad_device_arguments_exit_2(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--device", *argv, "--output", str(tmp_path)])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
    assert not (tmp_path / "datadist_bench_device.json").exists()


def test_the_device_benchmark_names_a_driver_it_cannot_load(tmp_path):
    done = _run(["--device", "--driver", str(tmp_path / "libcuda.so.1"), "--output", str(tmp_path)], timeout=60)
    assert done.returncode == 1
    assert f"the CUDA driver could not be loaded from {tmp_path / 'libcuda.so.1'}" in done.stderr
    assert not (tmp_path / "datadist_bench_device.json").exists()
