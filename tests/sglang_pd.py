"""SGLang servers in child processes, for the end-to-end tests and the benchmark.

Each ``Server`` is one ``python -m sglang.launch_server`` (CPU build, the
tiny test model, token ids in and out: no tokenizer) in its own process
group, so stopping it reaches the schedulers it spawned. ``Router`` is
sglang-router in ``--pd-disaggregation`` mode in front of a prefill and a
decode server. Every wait has a deadline; ``stop`` ends the group with
SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from vllm_pd import free_port_run, model_dir

HERE = Path(__file__).resolve().parent
__all__ = ["PAIRS", "Router", "Server", "assert_decode_follows_handed_kv", "assert_no_leak_reported",
           "finish_message", "free_port_run", "generate", "generate_outcome", "model_dir", "pd_generate",
           "two_prefills_into_one_decode"]

# What SGLang's CPU path needs on a machine without SGLang's CPU kernels.
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "PYTHONPATH": str(HERE / "sglang_cpu"),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}
# What a server of TP above 1 needs besides on the CPU: its ranks' cores
# (SGLang binds each rank's threads to one group of SGLANG_CPU_OMP_THREADS_BIND,
# by default one NUMA node a rank), and no NCCL: torch's CUDA build brings
# libnccl, and where it loads SGLang opens a NCCL communicator for every TP
# group, which fails on the CPU device ("Expected a cuda device, but got:
# cpu"); pointed at no library, SGLang goes without, as with a CPU build of
# torch.
NO_NCCL = str(HERE / "sglang_cpu" / "no-nccl")


def tp_env(tp_size: int) -> dict[str, str]:
    """The environment of a CPU server of ``tp_size`` ranks: this process's cores shared out among them."""
    if tp_size == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // tp_size)
    groups = [cores[rank * share % len(cores):][:share] for rank in range(tp_size)]
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, group)) for group in groups),
            "SGLANG_NCCL_SO_PATH": NO_NCCL}


START_TIMEOUT_S = float(os.environ.get("DATADIST_SGLANG_START_TIMEOUT_S", "420"))


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class _Process:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log_path = log
        self._log = open(log, "wb")
        full_env = {**os.environ, **env}
        if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):
            full_env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + os.environ["PYTHONPATH"]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_healthy(self, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if _healthy(url):
                return
            time.sleep(1.0)
        raise TimeoutError(f"{self.log_path.name} not healthy at {url} in time:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        stop_all([self])


def stop_all(processes: "list[_Process]") -> None:
    """Stops servers and routers together: each asked to end (SIGTERM), all
    given 20 s in all, then each one's process group killed (the schedulers
    a server spawned)."""
    for process in processes:
        if process.proc.poll() is None:
            process.signal(signal.SIGCONT)
            process.signal(signal.SIGTERM)
    _wait_all(processes, 20)
    for process in processes:
        process.signal(signal.SIGKILL)
    _wait_all(processes, 10)
    for process in processes:
        process._log.close()


def _wait_all(processes: "list[_Process]", seconds: float) -> None:
    """Waits for the processes to end, ``seconds`` for all of them."""
    deadline = time.monotonic() + seconds
    for process in processes:
        try:
            process.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


class Server(_Process):
    """One SGLang server: ``mode`` is "null" (no disaggregation), "prefill" or "decode".

    ``nccl_port`` is the port of its ranks' rendezvous (torch's TCPStore). It
    is given, from the caller's run of free ports: left to SGLang, it is a
    random free port below the ephemeral range, which can be one a caller
    reserved for another server that has not bound it yet."""

    def __init__(self, model: Path, mode: str, port: int, log_dir: Path, *, nccl_port: int,
                 backend: str = "datadist_aio", bootstrap_port: int = 0, page_size: int = 1, tp_size: int = 1, extra: Optional[list[str]] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        self.port, self.mode, self.bootstrap_port = port, mode, bootstrap_port
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-overlap-schedule", "--skip-tokenizer-init", "--dtype", "float32",
            "--max-total-tokens", "8192", "--page-size", str(page_size), "--tp-size", str(tp_size),
            "--mem-fraction-static", "0.6", "--log-level", "info", "--nccl-port", str(nccl_port),
        ]
        if mode != "null":
            argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
        if mode == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if mode == "decode":
            argv += ["--disaggregation-decode-retraction-backup", "none"]
        argv += extra or []
        merged = {**CPU_ENV, **tp_env(tp_size), **(env or {})}
        if env and "PYTHONPATH" in env:  # in front of the CPU stand-ins, not instead
            merged["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + CPU_ENV["PYTHONPATH"]
        super().__init__(argv, log_dir / f"sglang-{mode}-{port}.log", merged)

    def ready(self, deadline: float) -> "Server":
        self.wait_healthy(f"{self.url}/health", deadline)
        return self


class Router(_Process):
    """sglang-router in PD mode in front of one prefill and one decode server."""

    def __init__(self, prefill: Server, decode: Server, port: int, log_dir: Path,
                 metrics_port: Optional[int] = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        ]
        if metrics_port is not None:  # several routers: each its own (the default is one fixed port)
            argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        super().__init__(argv, log_dir / f"sglang-router-{port}.log", {})

    def ready(self, deadline: float) -> "Router":
        # /health answers as soon as the router listens, before it has
        # registered its workers (a request then gets 503, "No prefill
        # workers available"); /readiness waits for healthy workers.
        self.wait_healthy(f"{self.url}/readiness", deadline)
        return self


def _sampling(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 120.0,
             **fields: Any) -> dict[str, Any]:
    """One greedy request to ``url`` (a server or the router); the answer as JSON."""
    body = {"input_ids": input_ids, "sampling_params": _sampling(max_new_tokens), **fields}
    return _post(f"{url}/generate", body, timeout)


def generate_outcome(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 120.0,
                     **fields: Any) -> tuple[int, dict[str, Any]]:
    """As ``generate``, but an HTTP error is an answer too: (status, body as JSON or {"text": ...})."""
    try:
        return 200, generate(url, input_ids, max_new_tokens, timeout, **fields)
    except urllib.error.HTTPError as error:
        text = error.read().decode("utf-8", "replace")
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"text": text}


def finish_message(body: dict[str, Any]) -> str:
    """Why a request ended: its abort message, or its error's, as text."""
    finish = (body.get("meta_info") or {}).get("finish_reason") or {}
    return json.dumps(finish if finish.get("type") == "abort" else body)


def pd_generate(prefill: Server, decode: Server, prefill_ids: list[int], decode_ids: list[int], room: int,
                max_new_tokens: int, timeout: float = 120.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the router does, by hand: the same bootstrap room to a prefill and a decode server,
    each with its own prompt (the control hands the decode another prompt's KV)."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    answers: dict[str, Any] = {}

    def run(name: str, server: Server, ids: list[int]) -> None:
        try:
            answers[name] = generate(server.url, ids, max_new_tokens, timeout, **boot)
        except Exception as exc:  # reported below
            answers[name] = exc

    threads = [threading.Thread(target=run, args=("prefill", prefill, prefill_ids)),
               threading.Thread(target=run, args=("decode", decode, decode_ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    for name in ("prefill", "decode"):
        if isinstance(answers.get(name), Exception) or name not in answers:
            raise RuntimeError(f"{name} request failed: {answers.get(name)!r}")
    return answers["prefill"], answers["decode"]


def assert_decode_follows_handed_kv(reference: Server, prefill: Server, decode: Server, seed: int,
                                    max_new_tokens: int, length: int = 48) -> None:
    """The control: the decode, handed the KV of another prompt than its own, continues that
    prompt (the reference server's tokens for it), not its own. The bytes moved."""
    import random

    rng = random.Random(seed)
    mine, theirs = ([rng.randrange(3, 1000) for _ in range(length)] for _ in range(2))
    want_theirs = generate(reference.url, theirs, max_new_tokens)["output_ids"]
    assert generate(reference.url, mine, max_new_tokens)["output_ids"] != want_theirs
    _, decoded = pd_generate(prefill, decode, theirs, mine, rng.randrange(1 << 62), max_new_tokens)
    assert decoded["output_ids"] == want_theirs
    for server in (prefill, decode):
        assert_no_leak_reported(server)


def assert_stages_token_exact(reference: Server, router: Router, prefill: Server, decode: Server,
                              prompts: list[list[int]], max_new_tokens: int) -> None:
    """A prefill of two pipeline stages through ``router`` into ``decode``: every prompt the
    reference's tokens, the decode linked to both stages, and the control."""
    for prompt in prompts:
        want = generate(reference.url, prompt, max_new_tokens)["output_ids"]
        got = generate(router.url, prompt, max_new_tokens)["output_ids"]
        assert got == want, f"a prompt of {len(prompt)} tokens: {got} != {want}"
    log = Path(decode.log_path).read_text(errors="replace")
    linked = [line for line in log.splitlines() if "datadist_aio: linked to the prefill" in line]
    assert any("(PP 1/2 from layer 2," in line for line in linked), linked
    assert_decode_follows_handed_kv(reference, prefill, decode, 13, max_new_tokens)
    assert_no_leak_reported(decode)


def assert_no_leak_reported(server: Server) -> None:
    """SGLang's idle check found no page or request slot left allocated on ``server``."""
    log = Path(server.log_path).read_text(errors="replace")
    assert "memory leak detected" not in log


# The routers of ``two_prefills_into_one_decode``, each with its prefill server's name.
PAIRS = {"router": "prefill", "tp2-into-tp1": "prefill_tp2"}


@contextmanager
def two_prefills_into_one_decode(model: Path, root: Path, page_size: int) -> Iterator[dict[str, Any]]:
    """A reference server (no disaggregation), a prefill server of TP 1 and one of TP 2 (prefill
    chunks of 64 tokens), one decode server, all with pages of ``page_size`` tokens, and a router
    in front of each prefill and the decode (``PAIRS``); every process stopped on the way out."""
    tp2_extra = ["--sleep-on-idle"]  # idle, a TP 2 scheduler spins on the CPU (test_sglang_e2e.py)
    chunks = ["--chunked-prefill-size", "64"]
    base = free_port_run(14)
    started: list[Any] = []
    try:
        reference = Server(model, "null", base, root, nccl_port=base + 10)
        started.append(reference)
        prefill = Server(model, "prefill", base + 1, root, nccl_port=base + 11, bootstrap_port=base + 2,
                         page_size=page_size, extra=chunks)
        started.append(prefill)
        decode = Server(model, "decode", base + 3, root, nccl_port=base + 12, page_size=page_size)
        started.append(decode)
        prefill_tp2 = Server(model, "prefill", base + 4, root, nccl_port=base + 13, bootstrap_port=base + 5,
                             page_size=page_size, tp_size=2, extra=chunks + tp2_extra)
        started.append(prefill_tp2)
        deadline = time.monotonic() + 600
        for server in (prefill, decode, reference, prefill_tp2):
            server.ready(deadline)
        routers = {"router": Router(prefill, decode, base + 6, root, base + 8),
                   "tp2-into-tp1": Router(prefill_tp2, decode, base + 7, root, base + 9)}
        started += routers.values()
        for router in routers.values():
            router.ready(time.monotonic() + 300)
        yield {"reference": reference, "prefill": prefill, "decode": decode, "prefill_tp2": prefill_tp2, **routers}
    finally:
        stop_all(list(reversed(started)))
