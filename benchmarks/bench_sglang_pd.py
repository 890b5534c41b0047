"""SGLang prefill/decode pairs on CPU: datadist_aio's transfer backend against SGLang's Mooncake backend.

For each round and backend (alternating), a prefill server and a decode
server of SGLang's CPU build (the tiny test model, pages of 16 tokens) are
started, warmed up, and sent ``--requests`` prompts of ``--length`` tokens,
one at a time, the same prompts for every backend. Per request:

- transfer ms: SGLang's own measure on the prefill, the same for every
  backend (``sglang:kv_transfer_latency_ms``: from the request's entry into
  the prefill's transfer queue to its sender's Success), read per request
  as the change of the histogram's sum;
- TTFT ms: from sending the request until the decode server streams its
  first token (prefill compute, transfer, the decode's first step);
- tokens: the decode's output against a server with no disaggregation.

Mooncake runs over TCP (``MOONCAKE_PROTOCOL=tcp``, its
``mooncake-transfer-engine-non-cuda`` wheel). Its sender sets
``supports_host_tensor_indices``, which makes the prefill stage page indices
through pinned memory and a ``torch.cuda.Event``: without a GPU that
fails, so its servers run with the flag off (``sglang_mooncake_cpu/``, an
import hook on ``PYTHONPATH``), which sends the same page indices as a numpy
array. Both backends get the same servers, model and prompts.

    build/venv-sglang/bin/python benchmarks/bench_sglang_pd.py --rounds 2
    build/venv-sglang/bin/python benchmarks/bench_sglang_pd.py --rounds 2 --prefill-pp 2   # a prefill of 2 stages

Prints a table and writes JSON (``--output``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from sglang_pd import Server, free_port_run, generate, model_dir, tp_env  # noqa: E402

PAGE_SIZE = 16
BACKENDS = {
    "datadist_aio": {},
    "mooncake": {"MOONCAKE_PROTOCOL": "tcp", "PYTHONPATH": str(HERE / "sglang_mooncake_cpu")},
}


def _metric_sum(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}_sum"))


def _stream_first_token(url: str, ids: list[int], new_tokens: int, boot: dict[str, Any]) -> tuple[float, list[int]]:
    """Streams a request to ``url``; (seconds to its first token, all output ids)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                                                    "ignore_eos": True}, **boot}
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = 0.0
    output: list[int] = []
    with urllib.request.urlopen(request, timeout=300) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            ids_now = chunk.get("output_ids") or []
            if ids_now and not first:
                first = time.perf_counter() - start
            output = ids_now if len(ids_now) >= len(output) else output + ids_now
    return first, output


def _one(prefill: Server, decode: Server, ids: list[int], new_tokens: int, room: int) -> tuple[float, list[int]]:
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    errors: list[BaseException] = []

    def prefill_side() -> None:
        try:
            generate(prefill.url, ids, new_tokens, 300, **boot)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=prefill_side)
    thread.start()
    try:
        ttft, output = _stream_first_token(decode.url, ids, new_tokens, boot)
    finally:
        thread.join(310)
    if errors:
        raise RuntimeError(f"prefill request failed: {errors[0]!r}")
    return ttft, output


def run_backend(backend: str, model: Path, root: Path, prompts: list[list[int]], references: list[list[int]],
                new_tokens: int, warmup: int, prefill_pp: int = 1) -> dict[str, Any]:
    base = free_port_run(6)  # the last two: the servers' rendezvous ports
    env = BACKENDS[backend]
    metrics = ["--enable-metrics"]
    # A prefill of pipeline stages: each rank its share of the cores, asleep when idle.
    staged = ["--pp-size", str(prefill_pp), "--sleep-on-idle"] if prefill_pp > 1 else []
    prefill_env = {**env, **tp_env(prefill_pp)} if prefill_pp > 1 else env
    prefill = Server(model, "prefill", base, root, nccl_port=base + 4, backend=backend, bootstrap_port=base + 1,
                     page_size=PAGE_SIZE, extra=metrics + staged, env=prefill_env)
    decode = Server(model, "decode", base + 2, root, nccl_port=base + 5, backend=backend, page_size=PAGE_SIZE,
                    extra=metrics, env=env)
    try:
        deadline = time.monotonic() + 600
        prefill.ready(deadline)
        decode.ready(deadline)
        rng = random.Random(backend)
        for ids in prompts[:warmup]:
            _one(prefill, decode, ids, new_tokens, rng.randrange(1 << 62))
        transfers, ttfts, exact = [], [], 0
        for ids, want in zip(prompts, references):
            before = _metric_sum(prefill.url, "sglang:kv_transfer_latency_ms")
            ttft, output = _one(prefill, decode, ids, new_tokens, rng.randrange(1 << 62))
            time.sleep(0.05)  # the prefill records the transfer when its sender concludes
            transfers.append(_metric_sum(prefill.url, "sglang:kv_transfer_latency_ms") - before)
            ttfts.append(ttft * 1000)
            exact += output == want
        return {"backend": backend, "transfer_ms": transfers, "ttft_ms": ttfts, "exact": exact,
                "requests": len(prompts), "median_transfer_ms": statistics.median(transfers),
                "median_ttft_ms": statistics.median(ttfts)}
    finally:
        decode.stop()
        prefill.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="datadist_aio,mooncake")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefill-pp", type=int, default=1, help="pipeline stages of the prefill server")
    parser.add_argument("--root", type=Path, default=Path("build/bench-sglang"))
    parser.add_argument("--output", type=Path, default=Path("build/bench-sglang/bench_sglang_pd.json"))
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {sorted(BACKENDS)}")
    args.root.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.root)
    rng = random.Random(2026)
    prompts = [[rng.randrange(3, 1024) for _ in range(args.length)] for _ in range(args.requests)]
    port = free_port_run(2)
    reference = Server(model, "null", port, args.root, nccl_port=port + 1)
    try:
        reference.ready(time.monotonic() + 600)
        references = [generate(reference.url, ids, args.new_tokens)["output_ids"] for ids in prompts]
    finally:
        reference.stop()
    results = []
    for round_ in range(args.rounds):
        for backend in backends if round_ % 2 == 0 else backends[::-1]:
            result = run_backend(backend, model, args.root, prompts, references, args.new_tokens, args.warmup,
                                 args.prefill_pp)
            result["round"] = round_
            results.append(result)
            print(f"round {round_} {backend:13s} transfer {result['median_transfer_ms']:7.2f} ms  "
                  f"TTFT {result['median_ttft_ms']:7.1f} ms  exact {result['exact']}/{result['requests']}",
                  flush=True)
    print("\nbackend        median transfer ms (range of runs)   median TTFT ms (range)   token-exact")
    for backend in backends:
        mine = [r for r in results if r["backend"] == backend]
        t = [r["median_transfer_ms"] for r in mine]
        f = [r["median_ttft_ms"] for r in mine]
        print(f"{backend:13s}  {statistics.median(t):7.2f} ({min(t):.2f}-{max(t):.2f})"
              f"            {statistics.median(f):7.1f} ({min(f):.1f}-{max(f):.1f})"
              f"      {sum(r['exact'] for r in mine)}/{sum(r['requests'] for r in mine)}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"length": args.length, "page_size": PAGE_SIZE, "prefill_pp": args.prefill_pp,
                                       "results": results}, indent=1))


if __name__ == "__main__":
    main()
