"""vLLM engines in child processes, for the end-to-end tests and the benchmark.

Each ``Engine`` is one vLLM instance (engine core and worker in the child
process itself, so a signal to the child reaches the whole instance) driven
over a Pipe: token-id prompts in, token ids, finish reasons,
``kv_transfer_params`` and first-token times out. Children are started with
the spawn method and killed if they miss a deadline.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32


def model_dir(root: Path, variant: str = "llama", layers: Optional[int] = None) -> Path:
    """The tiny test model (``llama``; ``mla``: DeepSeek-V2 attention;
    ``minicpm3``: the same latent attention, for SGLang's CPU build;
    ``mellum``: sliding-window and full attention layers) under
    ``root`` (weights made once, from a fixed seed); ``layers``: with that
    many layers instead of the variant's own."""
    import sys

    sys.path.insert(0, str(HERE / "vllm_model"))
    from make_weights import make

    target = root / (f"tiny-{variant}" if layers is None else f"tiny-{variant}-{layers}-layers")
    if not (target / "model.safetensors").exists():
        make(target, variant=variant, layers=layers)
    return target


def connector_config(kind: str, role: str, port: int, **extra: Any) -> dict[str, Any]:
    """``KVTransferConfig`` fields for our connector (``datadist``) or vLLM's NIXL one (``nixl``)."""
    if kind == "datadist":
        config: dict[str, Any] = {
            "kv_connector": "DatadistAioConnector",
            "kv_connector_module_path": "datadist_aio.integrations.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": port, **extra},
        }
    elif kind == "nixl":
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        if extra:
            config["kv_connector_extra_config"] = dict(extra)
    else:
        raise ValueError(kind)
    return config


# Each connector's transfer-time histogram and bytes histogram, as vLLM exports them.
XFER_METRICS = {
    "datadist": ("vllm:datadist_aio_xfer_time_seconds", "vllm:datadist_aio_bytes_transferred"),
    "nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred"),
}


def parting(tokens: list[int], reference: dict[str, Any]) -> Optional[tuple[int, float]]:
    """Where greedy ``tokens`` part from a reference run's (``generate(...,
    logprobs=k)``), and by how many nats the reference preferred its own
    token there (inf where the other was not among its top k, or the
    reference has no logprobs there); None if they do not part."""
    if tokens == reference["tokens"]:
        return None
    at = next((i for i, (a, b) in enumerate(zip(tokens, reference["tokens"])) if a != b), len(tokens))
    if at >= len(reference["logprobs"]) or at >= len(tokens):
        return at, float("inf")
    candidates = reference["logprobs"][at]
    return at, candidates.get(reference["tokens"][at], 0.0) - candidates.get(tokens[at], float("-inf"))


def free_port_run(count: int) -> int:
    """A free loopback port with ``count - 1`` free ports after it (one
    side channel per TP rank counts up from a base port).

    Chosen below the kernel's ephemeral range, so a port an engine is given
    by the kernel (a listener on port 0, an outgoing connection) cannot take
    it between this check and the engine's bind.
    """
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral = int(ports.read().split()[0])
    low = max(1024, ephemeral - 12000)
    for _ in range(200):
        base = random.randrange(low, ephemeral - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free ports in a row below {ephemeral}")


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    """How much metric ``name`` grew between two ``Engine.metrics()`` readings."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def _kv_group_kinds(llm: Any) -> list[str]:
    """The kinds of the engine's KV cache groups (its scheduler's, in this
    process), e.g. ``["SlidingWindowSpec", "FullAttentionSpec"]``."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return [type(group.kv_cache_spec).__name__ for group in scheduler.kv_cache_config.kv_cache_groups]


def _metric_values(llm: Any) -> dict[str, float]:
    """Counters and gauges by name; a histogram as its count, and ``name + "_sum"``."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "count", None)
            total = getattr(metric, "sum", None)
            if isinstance(total, (int, float)):
                values[metric.name + "_sum"] = values.get(metric.name + "_sum", 0.0) + float(total)
        if isinstance(value, (int, float)):
            values[metric.name] = values.get(metric.name, 0.0) + float(value)
    return values


def _ranks(llm_args: dict[str, Any]) -> int:
    """The model's ranks under ``vllm.LLM(**llm_args)``: its TP size times its PP size."""
    return int(llm_args.get("tensor_parallel_size", 1)) * int(llm_args.get("pipeline_parallel_size", 1))


def _starts_worker_processes(llm_args: dict[str, Any]) -> bool:
    """Whether ``vllm.LLM(**llm_args)`` runs its model in worker processes (the
    multiprocess executor: several ranks, or asked for)."""
    return _ranks(llm_args) > 1 or llm_args.get("distributed_executor_backend") == "mp"


def _engine_main(conn: Any, model: str, kv_transfer: Optional[dict[str, Any]], env: dict[str, str],
                 policy: Optional[str], llm_args: dict[str, Any]) -> None:
    os.environ.update(env)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        config = None
        if kv_transfer is not None:
            fields = dict(kv_transfer)
            if policy is not None:
                fields["kv_load_failure_policy"] = policy
            config = KVTransferConfig(**fields)
        args: dict[str, Any] = dict(
            model=model,
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=BLOCK_SIZE,
            max_model_len=4096,
            max_num_batched_tokens=4096,
            enforce_eager=True,
            kv_transfer_config=config,
            disable_log_stats=False,
            seed=0,
        )
        args.update(llm_args)
        workers = _ranks(args)
        if workers > 1:
            args.setdefault("distributed_executor_backend", "mp")
            # vLLM's CPU workers each bind their OpenMP threads to a CPU list:
            # one core each, round the machine's cores.
            cores = len(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(workers)))
        llm = LLM(**args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            return
        try:
            if command == "stop":
                conn.send(("ok", None))
                return
            if command == "metrics":
                conn.send(("ok", _metric_values(llm)))
                continue
            if command == "kv_groups":
                conn.send(("ok", _kv_group_kinds(llm)))
                continue
            assert command == "generate"
            prompts, max_tokens, params, logprobs = args
            sampling = [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    logprobs=logprobs or None,
                    extra_args={"kv_transfer_params": dict(p)} if p is not None else None,
                )
                for p in params
            ]
            start = time.monotonic()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
            wall = time.monotonic() - start
            results = []
            for output in outputs:
                completion = output.outputs[0]
                metrics = output.metrics
                ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
                results.append(
                    {
                        "tokens": list(completion.token_ids),
                        "finish_reason": completion.finish_reason,
                        "kv_transfer_params": output.kv_transfer_params,
                        "ttft": ttft,
                        # Per generated token: {token id: logprob} of the top candidates.
                        "logprobs": [{int(t): float(lp.logprob) for t, lp in step.items()}
                                     for step in completion.logprobs or []],
                    }
                )
            conn.send(("ok", {"results": results, "wall": wall}))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def engine_child(fd: int) -> None:
    """An engine's process started by other means than ``Engine._spawn``
    (another namespace): its arguments and commands come over the
    ``multiprocessing.connection.Connection`` on descriptor ``fd``."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    _engine_main(conn, *conn.recv())


class EngineError(RuntimeError):
    pass


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T``)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


class Engine:
    """One vLLM instance in a child process."""

    def __init__(self, model: Path, kv_transfer: Optional[dict[str, Any]] = None, *,
                 policy: Optional[str] = None, env: Optional[dict[str, str]] = None,
                 start_timeout: float = 400.0, **llm_args: Any) -> None:
        """``llm_args`` go to ``vllm.LLM`` over the defaults (``tensor_parallel_size``,
        ``block_size``, ``enable_prefix_caching``, ...); TP or PP above 1 runs
        its workers as processes (``distributed_executor_backend="mp"``)."""
        # Our connector's side channel (its rank 0's), where a decode-first decode reaches this prefill.
        extra = (kv_transfer or {}).get("kv_connector_extra_config") or {}
        self.side_channel_port = int(extra.get("side_channel_port", 0) or 0)
        self.side_channel_host = str(extra.get("side_channel_host", "127.0.0.1"))
        self.process, self._conn = self._spawn((str(model), kv_transfer, dict(env or {}), policy, llm_args))
        self.stopped = False
        kind, value = self._answer(start_timeout)
        if kind != "ready":
            self.kill()
            raise EngineError(f"engine did not start:\n{value}")
        self.pid = int(value)

    def _spawn(self, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """Starts the child process (``_engine_main(conn, *args)``): returns it
        (``is_alive``, ``kill``, ``join``, ``pid``) and this side's connection."""
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        process = ctx.Process(
            target=_engine_main, args=(child, *args),
            # A daemonic process may not start vLLM's worker processes (TP or
            # PP, or the multiprocess executor asked for); close() and kill()
            # end it either way.
            daemon=not _starts_worker_processes(args[-1]),
        )
        process.start()
        child.close()
        return process, conn

    def _answer(self, timeout: float) -> tuple[str, Any]:
        if not self._conn.poll(timeout):
            self.kill()
            raise EngineError(f"engine {self.process.pid} did not answer within {timeout} s")
        try:
            return self._conn.recv()
        except EOFError:
            self.kill()
            raise EngineError(f"engine {self.process.pid} died") from None

    def call(self, command: str, args: Any = None, timeout: float = 300.0) -> Any:
        self._conn.send((command, args))
        kind, value = self._answer(timeout)
        if kind != "ok":
            raise EngineError(value)
        return value

    def generate(self, prompts: list[list[int]], max_tokens: int, params: Optional[list[Any]] = None,
                 timeout: float = 300.0, logprobs: int = 0) -> dict[str, Any]:
        """Greedy outputs; ``logprobs`` > 0 also gives each token's top candidates."""
        return self.call("generate", (prompts, max_tokens, params or [None] * len(prompts), logprobs), timeout)

    def metrics(self) -> dict[str, float]:
        return self.call("metrics", None, 60.0)

    def kv_groups(self) -> list[str]:
        """The kinds of the instance's KV cache groups (two or more: vLLM's hybrid KV cache manager is on)."""
        return self.call("kv_groups", None, 60.0)

    def stop_signal(self, timeout: float = 10.0) -> None:
        """Freezes the engine's process and returns once every one of its
        threads is stopped: a thread the signal has not reached yet could
        still serve a transfer."""
        os.kill(self.process.pid, signal.SIGSTOP)
        self.stopped = True
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(self.process.pid):
            if time.monotonic() > deadline:
                raise EngineError(f"engine {self.process.pid} did not stop within {timeout} s")
            time.sleep(0.001)

    def cont_signal(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=30)
        self._conn.close()

    def close(self) -> None:
        if not self.process.is_alive():
            self._conn.close()
            return
        if self.stopped:
            self.cont_signal()
        try:
            self.call("stop", None, 30.0)
        except (EngineError, OSError):
            pass
        self.process.join(timeout=30)
        self.kill()


def start_engines(factories: "list[tuple[str, Callable[[], Engine]]]") -> "dict[str, Engine]":
    """Starts engines side by side (each factory makes one and waits until it
    is ready); returns them by name. Where one fails, those that started are
    closed and the first failure is raised."""
    import concurrent.futures

    running: dict[str, Engine] = {}
    failure: Optional[BaseException] = None
    with concurrent.futures.ThreadPoolExecutor(max(1, len(factories))) as pool:
        futures = {name: pool.submit(factory) for name, factory in factories}
        for name, future in futures.items():
            try:
                running[name] = future.result()
            except BaseException as exc:  # noqa: BLE001  (the others still start, then close)
                failure = failure or exc
    if failure is not None:
        close_engines(list(running.values()))
        raise failure
    return {name: running[name] for name, _ in factories}


def close_engines(engines: "list[Engine]") -> None:
    """Closes engines side by side."""
    import concurrent.futures

    if engines:
        with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda engine: engine.close(), engines))


def prompts_of_lengths(lengths: list[int], seed: int, vocab: int = 1024) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# Where a test checks that pushes overlapped their forwards: the decodes'
# requests go first by this much (``decode_first_run``).
EXPECT_LEAD_S = 1.0


def decode_first_run(jobs: list[tuple[Engine, int, Engine, list[int], list[int]]], max_tokens: int,
                     prefill_tp: int = 1, host: str = "127.0.0.1", decode_lead_s: float = 0.0) -> dict[str, Any]:
    """Runs ``(prefill, its side-channel port, decode, prefill's prompt,
    decode's prompt)`` jobs as a decode-first proxy does: both instances get
    the request at once with the same ``transfer_id`` (the prefill's side
    channel at ``host``), each instance all its requests in one call, all
    instances side by side. Returns the decodes' ``results`` in job order,
    and the longest ``prefill_wall`` and ``decode_wall`` of the calls.

    ``decode_lead_s``: the prefills get their requests this long after the
    decodes, so that the decodes' expects are there before the prefills'
    forwards start (a check of the overlap must not hang on which of two
    busy processes the machine ran first)."""
    import secrets
    import threading

    work: dict[int, tuple[Engine, list[tuple[int, list[int], dict[str, Any]]], bool]] = {}
    for index, (prefill, port, decode, prefill_prompt, decode_prompt) in enumerate(jobs):
        transfer_id = secrets.token_hex(8)
        work.setdefault(id(prefill), (prefill, [], True))[1].append(
            (index, prefill_prompt, {"do_remote_decode": True, "transfer_id": transfer_id}))
        work.setdefault(id(decode), (decode, [], False))[1].append((index, decode_prompt, {
            "do_remote_prefill": True, "transfer_id": transfer_id, "remote_host": host,
            "remote_port": port, "tp_size": prefill_tp}))
    outputs: dict[int, dict[str, Any]] = {}
    walls = {"prefill_wall": 0.0, "decode_wall": 0.0}
    errors: list[BaseException] = []

    def run(engine: Engine, items: list[tuple[int, list[int], dict[str, Any]]], is_prefill: bool) -> None:
        try:
            run = engine.generate([p for _, p, _ in items], 1 if is_prefill else max_tokens,
                                  [params for _, _, params in items])
            key = "prefill_wall" if is_prefill else "decode_wall"
            walls[key] = max(walls[key], run["wall"])
            if not is_prefill:
                outputs.update((index, result) for (index, _, _), result in zip(items, run["results"]))
        except BaseException as exc:  # noqa: BLE001  (raised again below)
            errors.append(exc)

    decodes = [threading.Thread(target=run, args=value) for value in work.values() if not value[2]]
    prefills = [threading.Thread(target=run, args=value) for value in work.values() if value[2]]
    for thread in decodes:
        thread.start()
    time.sleep(decode_lead_s)
    for thread in prefills:
        thread.start()
    for thread in decodes + prefills:
        thread.join(timeout=600)
    if errors:
        raise errors[0]
    return {"results": [outputs[index] for index in range(len(jobs))], **walls}


def decode_first(jobs: list[tuple[Engine, int, Engine, list[int], list[int]]], max_tokens: int,
                 prefill_tp: int = 1, decode_lead_s: float = 0.0) -> list[list[int]]:
    """The decodes' tokens of ``decode_first_run``, in job order."""
    return [result["tokens"] for result in
            decode_first_run(jobs, max_tokens, prefill_tp, decode_lead_s=decode_lead_s)["results"]]
