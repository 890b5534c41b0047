"""A prefill vLLM and a decode vLLM with DatadistAioConnector (``datadist``:
the decode side pulls; ``push``: the prefill pushes layer by layer into the
decode side's inbox) and with vLLM's NixlConnector (``kv_buffer_device="cpu"``),
in the same run.

Each connector runs ``--rounds`` times, alternating (ours, NIXL, NIXL, ours,
...), each run with a fresh pair of engines. A run sends ``--warmup``
requests first (links and handshakes happen there) and then ``--requests``
requests one at a time: a prefill of the prompt (``do_remote_decode``, one
token), then a greedy decode with the returned ``kv_transfer_params``. Per
request it records the KV bytes, the connector's own transfer time (the
delta of its ``*_xfer_time_seconds`` histogram: ours from the start of the
read to the settled task, NIXL's from posting to completion), the decode
side's time to first token (from vLLM's request metrics: arrival to first
token, which holds the load) and the wall time of prefill plus decode. The
decode output is checked against a single-instance run of the same prompt.
For ``push`` the transfer happens inside the prefill's step: its time is the
prefill side's histogram (from the step's first claim to the commit), and
the decode side's is the copy out of the inbox; the prefill's wall time
(``prefill_ms``) holds the push.

Medians over the requests of each run, and over all runs of a connector, go
to stdout and to ``--output`` (JSON). Needs vLLM (CPU build) and, for the
comparison, ``pip install --no-deps nixl nixl-cu12``.

    python benchmarks/bench_vllm_pd.py --rounds 2 --requests 16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from vllm_pd import Engine, EngineError, connector_config, model_dir, prompts_of_lengths  # noqa: E402

METRICS = {
    "datadist": ("vllm:datadist_aio_xfer_time_seconds", "vllm:datadist_aio_bytes_transferred"),
    "nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred"),
}
METRICS["push"] = METRICS["datadist"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_pair(kind: str, model: Path) -> tuple[Engine, Engine]:
    if kind == "datadist":
        prefill = Engine(model, connector_config(kind, "kv_producer", free_port()))
        decode_engine = Engine(model, connector_config(kind, "kv_consumer", 0), policy="recompute")
        return prefill, decode_engine
    if kind == "push":
        port = free_port()
        decode_engine = Engine(model, connector_config("datadist", "kv_consumer", port, transfer_mode="push_layerwise"),
                               policy="recompute")
        prefill = Engine(model, connector_config("datadist", "kv_producer", free_port(),
                                                 transfer_mode="push_layerwise", push_port=port))
        return prefill, decode_engine
    prefill = Engine(model, connector_config(kind, "kv_producer", 0),
                     env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"})
    decode_engine = Engine(model, connector_config(kind, "kv_consumer", 0), policy="recompute",
                           env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"})
    return prefill, decode_engine


def one_request(prefill: Engine, decode: Engine, prompt: list[int], max_tokens: int, kind: str) -> dict[str, Any]:
    time_metric, bytes_metric = METRICS[kind]
    before = decode.metrics()
    pushed_before = prefill.metrics() if kind == "push" else {}
    start = time.monotonic()
    pre = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
    params = pre["results"][0]["kv_transfer_params"]
    dec = decode.generate([prompt], max_tokens, [params])
    wall = time.monotonic() - start
    after = decode.metrics()
    pushed_after = prefill.metrics() if kind == "push" else {}
    result = dec["results"][0]
    return {
        "prompt_tokens": len(prompt),
        "tokens": result["tokens"],
        "transfers": after.get(time_metric, 0.0) - before.get(time_metric, 0.0),
        "xfer_s": after.get(time_metric + "_sum", 0.0) - before.get(time_metric + "_sum", 0.0),
        "bytes": after.get(bytes_metric + "_sum", 0.0) - before.get(bytes_metric + "_sum", 0.0),
        "ttft_s": result["ttft"],
        "push_s": pushed_after.get(time_metric + "_sum", 0.0) - pushed_before.get(time_metric + "_sum", 0.0),
        "prefill_wall_s": pre["wall"],
        "decode_wall_s": dec["wall"],
        "wall_s": wall,
    }


def run_once(kind: str, model: Path, prompts: list[list[int]], reference: list[list[int]], warmup: int,
             max_tokens: int) -> dict[str, Any]:
    prefill, decode = start_pair(kind, model)
    try:
        for prompt in prompts_of_lengths([100] * warmup, seed=99):
            one_request(prefill, decode, prompt, max_tokens, kind)
        rows = [one_request(prefill, decode, p, max_tokens, kind) for p in prompts]
    finally:
        decode.close()
        prefill.close()
    exact = all(row["tokens"] == ref for row, ref in zip(rows, reference))
    measured = [row for row in rows if row["transfers"] == 1]
    return {
        "kind": kind,
        "exact": exact,
        "requests": len(rows),
        "measured": len(measured),
        "median_xfer_ms": statistics.median(r["xfer_s"] for r in measured) * 1e3 if measured else None,
        "median_ttft_ms": statistics.median(r["ttft_s"] for r in rows) * 1e3,
        "median_wall_ms": statistics.median(r["wall_s"] for r in rows) * 1e3,
        "median_push_ms": statistics.median(r["push_s"] for r in measured) * 1e3 if measured else None,
        "median_prefill_ms": statistics.median(r["prefill_wall_s"] for r in rows) * 1e3,
        "median_bytes": statistics.median(r["bytes"] for r in measured) if measured else None,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs per connector (alternating)")
    parser.add_argument("--requests", type=int, default=16, help="measured requests per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths, cycled")
    parser.add_argument("--connectors", default="datadist,push,nixl")
    parser.add_argument("--output", type=Path, default=Path("build/bench-vllm-pd.json"))
    args = parser.parse_args()

    kinds = [k for k in args.connectors.split(",") if k]
    if "nixl" in kinds and importlib.util.find_spec("nixl") is None:
        print("nixl is not installed: pip install --no-deps nixl nixl-cu12; measuring ours alone")
        kinds = [k for k in kinds if k != "nixl"]
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = prompts_of_lengths([lengths[i % len(lengths)] for i in range(args.requests)], seed=5)

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp))
        single = Engine(model)
        try:
            reference = [r["tokens"] for r in single.generate(prompts, args.max_tokens)["results"]]
        finally:
            single.close()
        runs = []
        for round_index in range(args.rounds):
            order = kinds if round_index % 2 == 0 else list(reversed(kinds))
            for kind in order:
                try:
                    run = run_once(kind, model, prompts, reference, args.warmup, args.max_tokens)
                except EngineError as exc:  # NIXL's engines sometimes die; the run goes again once
                    print(f"round {round_index + 1} {kind}: an engine died ({str(exc)[:200]}); running it again")
                    run = run_once(kind, model, prompts, reference, args.warmup, args.max_tokens)
                runs.append(run)
                print(
                    f"round {round_index + 1} {kind:8s} exact={run['exact']} measured={run['measured']}/"
                    f"{run['requests']} xfer={run['median_xfer_ms']:.2f} ms push={run['median_push_ms']:.2f} ms "
                    f"ttft={run['median_ttft_ms']:.1f} ms prefill={run['median_prefill_ms']:.1f} ms "
                    f"wall={run['median_wall_ms']:.1f} ms kv={run['median_bytes'] / 2**20:.2f} MiB",
                    flush=True,
                )

    print("\nconnector  runs  median xfer ms (range)    push ms (range)    median TTFT ms (range)"
          "    prefill ms (range)    median wall ms (range)  exact")
    summary = {}
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]

        def agg(key: str) -> tuple[float, float, float]:
            values = [r[key] for r in mine if r[key] is not None]
            return statistics.median(values), min(values), max(values)

        xfer, ttft, wall = agg("median_xfer_ms"), agg("median_ttft_ms"), agg("median_wall_ms")
        push, prefill_ms = agg("median_push_ms"), agg("median_prefill_ms")
        exact = all(r["exact"] for r in mine)
        summary[kind] = {"xfer_ms": xfer, "push_ms": push, "ttft_ms": ttft, "prefill_ms": prefill_ms,
                         "wall_ms": wall, "exact": exact}
        print(
            f"{kind:9s}  {len(mine):4d}  {xfer[0]:7.2f} ({xfer[1]:.2f}-{xfer[2]:.2f})"
            f"    {push[0]:6.2f} ({push[1]:.2f}-{push[2]:.2f})"
            f"    {ttft[0]:7.1f} ({ttft[1]:.1f}-{ttft[2]:.1f})"
            f"    {prefill_ms[0]:7.1f} ({prefill_ms[1]:.1f}-{prefill_ms[2]:.1f})"
            f"    {wall[0]:7.1f} ({wall[1]:.1f}-{wall[2]:.1f})  {exact}"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
