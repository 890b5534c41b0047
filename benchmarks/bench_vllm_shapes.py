"""Prefill and decode vLLM instances of different shapes: DatadistAioConnector
against vLLM's NixlConnector, in the same run.

Shapes: prefill TP=2 into decode TP=1, TP=1 into TP=2, blocks of 32 tokens
into blocks of 64 (vLLM's CPU attention takes multiples of 32), a prefill of
two pipeline stages into a decode of one and into one of two. Per shape and
connector, one fresh pair of engines (connectors alternating, ours first in
odd rounds):

- every prompt, one at a time, prefilled then decoded: the connector's own
  transfer time per request (its histogram; a request read by two decode
  ranks or from two prefill ranks gives the mean of its reads, which run
  side by side), the decode's TTFT, and the output against the prefill
  instance computing alone: exact, a near tie (the reference's two best
  tokens within 0.05 nats where they part; another TP size sums in another
  order), or wrong;
- the same prompts again (prefix caching is on in both instances): the
  bytes the second pass moved against the first;
- the control: prompt a's tokens with prompt b's KV, whose output must
  follow b (else the KV did not arrive).

    python benchmarks/bench_vllm_shapes.py --rounds 2

Prints a table of medians per run and median (range) over the runs, the
largest transfer and TTFT of any request and the loads counted failed, and
writes everything (with each run's 99th percentiles) to ``--output`` (JSON).

Stalls: ``--roles kv_both --policy fail --requests 16`` runs 16 prompts
(``--lengths`` cycled) per pair with both instances ``kv_both`` and
failed loads failing their requests; ``--passes 1 --no-control`` leaves out
the second pass and the control. Each run then also prints its p99 and
largest transfer against its median (a run whose largest is
``--stall-ratio`` times its median or more, or with a failed load, is
named), the machine's load average over the run, and how long a probe
thread of the benchmark waited for a core during the slowest request (a
transfer about as slow as that wait was held by the machine). The check of TP 1
into 2 and 2 into 1, 10 runs of 16 requests each:

    python benchmarks/bench_vllm_shapes.py --connectors datadist --shapes tp1_into_tp2,tp2_into_tp1 \
        --rounds 10 --requests 16 --roles kv_both --policy fail --passes 1 --no-control
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from vllm_pd import (  # noqa: E402
    Engine,
    EngineError,
    XFER_METRICS,
    connector_config,
    delta,
    free_port_run,
    model_dir,
    parting,
    prompts_of_lengths,
)

SHAPES = {
    "tp2_into_tp1": ({"tensor_parallel_size": 2}, {}),
    "tp1_into_tp2": ({}, {"tensor_parallel_size": 2}),
    "block32_into_block64": ({"block_size": 32}, {"block_size": 64}),
    # Pipeline stages: vLLM's CPU build runs them compiled only (eager, a
    # second stage's worker fails its first step; tests/test_vllm_pp.py).
    "pp2_into_pp1": ({"pipeline_parallel_size": 2, "enforce_eager": False}, {}),
    "pp2_into_pp2": ({"pipeline_parallel_size": 2, "enforce_eager": False},
                     {"pipeline_parallel_size": 2, "enforce_eager": False}),
}
METRICS = XFER_METRICS
FAILED = {"datadist": "vllm:datadist_aio_num_failed_transfers", "nixl": "vllm:nixl_num_failed_transfers"}
NEAR_TIE = 0.05


ROLES = {"producer_consumer": ("kv_producer", "kv_consumer"), "kv_both": ("kv_both", "kv_both")}


def start_pair(kind: str, shape: str, model: Path, roles: str = "producer_consumer",
               policy: str = "recompute") -> tuple[Engine, Engine]:
    prefill_args, decode_args = SHAPES[shape]
    prefill_role, decode_role = ROLES[roles]
    prefill_port, decode_port = free_port_run(4), free_port_run(4)
    while decode_port in range(prefill_port - 3, prefill_port + 4):
        decode_port = free_port_run(4)
    if kind == "datadist":
        prefill = Engine(model, connector_config(kind, prefill_role, prefill_port), **prefill_args)
        try:
            return prefill, Engine(model, connector_config(kind, decode_role, decode_port), policy=policy,
                                   **decode_args)
        except BaseException:
            prefill.close()
            raise

    def env(port: int) -> dict[str, str]:
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}

    prefill = Engine(model, connector_config(kind, prefill_role, 0), env=env(prefill_port), **prefill_args)
    try:
        return prefill, Engine(model, connector_config(kind, decode_role, 0), policy=policy,
                               env=env(decode_port), **decode_args)
    except BaseException:
        prefill.close()
        raise


def load_average() -> float:
    """The machine's 1-minute load average."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class StallProbe:
    """A thread that sleeps 1 ms at a time and keeps how late it woke: what a
    thread of this machine that wants a core waits for one. A transfer as
    slow as the probe's worst wait beside it says the machine held it."""

    def __init__(self) -> None:
        self._late: list[tuple[float, float]] = []  # (woke at, ms late)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            time.sleep(0.001)
            now = time.monotonic()
            late = (now - before - 0.001) * 1e3
            if late >= 1.0:
                self._late.append((now, late))
                if len(self._late) > 100_000:
                    del self._late[:50_000]

    def worst(self, since: float, until: float) -> float:
        """The longest late wake-up (ms) of the probe between two ``time.monotonic()`` readings."""
        return max((late for at, late in list(self._late) if since <= at <= until + 0.001), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


PROBE: Optional[StallProbe] = None


def verdict(tokens: list[int], reference: dict[str, Any]) -> str:
    """``exact``, ``near_tie`` or ``wrong`` against the reference's tokens and logprobs."""
    parted = parting(tokens, reference)
    if parted is None:
        return "exact"
    return "near_tie" if parted[1] <= NEAR_TIE else "wrong"


def one_pass(prefill: Engine, decode: Engine, prompts: list[list[int]], max_tokens: int, kind: str,
             reference: list[dict[str, Any]]) -> dict[str, Any]:
    time_metric, bytes_metric = METRICS[kind]
    rows = []
    for prompt, ref in zip(prompts, reference):
        load = load_average()
        before = decode.metrics()
        params = prefill.generate([prompt], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
        since = time.monotonic()
        (result,) = decode.generate([prompt], max_tokens, [params])["results"]
        until = time.monotonic()
        after = decode.metrics()
        rows.append({
            "prompt_tokens": len(prompt),
            "verdict": verdict(result["tokens"], ref),
            "ttft_s": result["ttft"],
            "transfers": delta(after, before, time_metric),
            "xfer_s": delta(after, before, time_metric + "_sum"),
            "bytes": delta(after, before, bytes_metric + "_sum"),
            "failed": delta(after, before, FAILED[kind]) if FAILED[kind] in after else 0.0,
            "load_average": load,
            "machine_stall_ms": PROBE.worst(since, until) if PROBE is not None else None,
        })
    return {"rows": rows}


def control(prefill: Engine, decode: Engine, max_tokens: int, seed: int) -> bool:
    """Prompt a's tokens with prompt b's KV: True if the output follows b, not a."""
    a, b = prompts_of_lengths([300, 300], seed=seed)
    a[-1] = b[-1]
    ref_a, ref_b = (r["tokens"] for r in prefill.generate([a, b], max_tokens)["results"])
    params = prefill.generate([b], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
    (got,) = (r["tokens"] for r in decode.generate([a], max_tokens, [params])["results"])
    return got != ref_a and got[:2] == ref_b[:2]


def run_one(kind: str, shape: str, model: Path, prompts: list[list[int]], max_tokens: int,
            seed: int, args: Optional[argparse.Namespace] = None) -> dict[str, Any]:
    roles = args.roles if args is not None else "producer_consumer"
    policy = args.policy if args is not None else "recompute"
    passes = args.passes if args is not None else 2
    with_control = args.control if args is not None else True
    prefill, decode = start_pair(kind, shape, model, roles, policy)
    try:
        reference = prefill.generate(prompts, max_tokens, logprobs=5)["results"]
        warm = prompts_of_lengths([64], seed=seed + 100)
        one_pass(prefill, decode, warm, max_tokens, kind, prefill.generate(warm, max_tokens, logprobs=5)["results"])
        first = one_pass(prefill, decode, prompts, max_tokens, kind, reference)
        second = one_pass(prefill, decode, prompts, max_tokens, kind, reference) if passes > 1 else {"rows": []}
        follows = control(prefill, decode, max_tokens, seed + 200) if with_control else None
    finally:
        decode.close()
        prefill.close()
    rows = first["rows"]
    # A request read by two decode ranks, or from two prefill ranks, is
    # counted twice, in parallel: its time is the mean of its reads.
    ms = [row["xfer_s"] / row["transfers"] * 1e3 for row in rows if row["transfers"] > 0]
    ttft = [row["ttft_s"] * 1e3 for row in rows if row["ttft_s"] is not None]
    verdicts = [row["verdict"] for row in rows] + [row["verdict"] for row in second["rows"]]
    both = rows + second["rows"]
    all_ms = [row["xfer_s"] / row["transfers"] * 1e3 for row in both if row["transfers"] > 0]
    all_ttft = [row["ttft_s"] * 1e3 for row in both if row["ttft_s"] is not None]
    median_ms = statistics.median(ms) if ms else None
    loads = [row["load_average"] for row in both]
    return {
        # The first pass alone (each request's whole read): its largest and
        # 99th percentile transfer against its median.
        "first_max_xfer_ms": max(ms) if ms else None,
        "first_p99_xfer_ms": _p99(ms),
        "max_over_median": max(ms) / median_ms if ms and median_ms else None,
        "slowest_request": ms.index(max(ms)) if ms else None,
        # The probe's longest wait for a core during the slowest request's decode.
        "slowest_machine_stall_ms": rows[ms.index(max(ms))].get("machine_stall_ms") if ms and len(ms) == len(rows)
        else None,
        # And its TTFT: far above the run's median, the whole instance stalled, not one read.
        "slowest_ttft_ms": (rows[ms.index(max(ms))]["ttft_s"] or 0) * 1e3 if ms and len(ms) == len(rows) else None,
        "load_average": [min(loads), statistics.mean(loads), max(loads)] if loads else None,
        "max_xfer_ms": max(all_ms) if all_ms else None,
        "p99_xfer_ms": _p99(all_ms),
        "max_ttft_ms": max(all_ttft) if all_ttft else None,
        "p99_ttft_ms": _p99(all_ttft),
        "failed_loads": sum(row["failed"] for row in both),
        "kind": kind,
        "shape": shape,
        "median_xfer_ms": median_ms,
        "median_ttft_ms": statistics.median(ttft) if ttft else None,
        "exact": verdicts.count("exact"),
        "near_tie": verdicts.count("near_tie"),
        "wrong": verdicts.count("wrong"),
        "bytes_first": sum(row["bytes"] for row in rows),
        "bytes_second": sum(row["bytes"] for row in second["rows"]),
        "control": follows,
        "first": rows,
        "second": second["rows"],
    }


def _p99(values: list[float]) -> Optional[float]:
    """The 99th percentile (nearest rank); the maximum below 100 values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, -(-99 * len(ordered) // 100) - 1)]


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _range(values: list[Optional[float]]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    return f"{statistics.median(present):.2f} ({min(present):.2f}-{max(present):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", default="50,200,500,1000,1500")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--connectors", default="datadist,nixl")
    parser.add_argument("--output", default="build/bench-vllm-shapes.json")
    parser.add_argument("--roles", choices=tuple(ROLES), default="producer_consumer",
                        help="kv_producer into kv_consumer, or both instances kv_both")
    parser.add_argument("--policy", choices=("recompute", "fail"), default="recompute",
                        help="the decode's kv_load_failure_policy")
    parser.add_argument("--requests", type=int, default=0,
                        help="prompts per pass (--lengths cycled); 0: one per length")
    parser.add_argument("--passes", type=int, choices=(1, 2), default=2,
                        help="2: the prompts again, to measure what prefix caching leaves to move")
    parser.add_argument("--no-control", dest="control", action="store_false", help="leave out the swap control")
    parser.add_argument("--stall-ratio", type=float, default=5.0,
                        help="name the runs whose largest transfer is this many times their median or more")
    args = parser.parse_args()
    import tempfile

    global PROBE
    PROBE = StallProbe()

    model = model_dir(Path(tempfile.mkdtemp(prefix="bench-shapes-")))
    lengths = [int(n) for n in args.lengths.split(",")]
    count = args.requests or len(lengths)
    prompts = prompts_of_lengths([lengths[i % len(lengths)] for i in range(count)], seed=11)
    kinds = args.connectors.split(",")
    results = []
    started = time.monotonic()
    for round_index in range(args.rounds):
        for shape in args.shapes.split(","):
            order = kinds if round_index % 2 == 0 else list(reversed(kinds))
            for kind in order:
                try:
                    result = run_one(kind, shape, model, prompts, args.max_tokens, seed=round_index, args=args)
                except EngineError as exc:
                    result = {"kind": kind, "shape": shape, "error": str(exc)[-2000:]}
                    print(f"round {round_index + 1} {shape} {kind}: failed: {str(exc)[-300:]}", flush=True)
                else:
                    print(f"round {round_index + 1} {shape:21s} {kind:8s} xfer={result['median_xfer_ms']} ms "
                          f"ttft={result['median_ttft_ms']} ms exact={result['exact']} near_tie={result['near_tie']} "
                          f"wrong={result['wrong']} bytes={result['bytes_first']:.0f}/{result['bytes_second']:.0f} "
                          f"control={result['control']} max xfer={result['max_xfer_ms']} ms "
                          f"max ttft={result['max_ttft_ms']} ms failed={result['failed_loads']:.0f}", flush=True)
                    ratio, loads = result["max_over_median"], result["load_average"]
                    over = result["failed_loads"] > 0 or (ratio is not None and ratio >= args.stall_ratio)
                    print(f"    first pass: {len(result['first'])} requests, failed={result['failed_loads']:.0f},"
                          f" transfer median {_fmt(result['median_xfer_ms'])} p99 {_fmt(result['first_p99_xfer_ms'])}"
                          f" max {_fmt(result['first_max_xfer_ms'])} ms (request {result['slowest_request']}),"
                          f" max/median {_fmt(ratio)}x{'  <-- OVER' if over else ''};"
                          f" that request's TTFT {_fmt(result['slowest_ttft_ms'], 1)} ms (median"
                          f" {_fmt(result['median_ttft_ms'], 1)}), the machine held a thread up to"
                          f" {_fmt(result['slowest_machine_stall_ms'], 1)} ms during it;"
                          f" load average {_fmt(loads[0], 1)}-{_fmt(loads[2], 1)} (mean {_fmt(loads[1], 1)})",
                          flush=True)
                results.append({"round": round_index + 1, **result})
    print(f"\nMedian (range) over runs; {time.monotonic() - started:.0f} s in all.")
    print(f"{'shape':21s}  {'connector':9s}  {'transfer ms/req':20s}  {'TTFT ms':20s}  exact/tie/wrong  "
          "bytes 2nd/1st  control  max xfer ms  max TTFT ms  failed")
    for shape in args.shapes.split(","):
        for kind in kinds:
            runs = [r for r in results if r["shape"] == shape and r["kind"] == kind and "error" not in r]
            if not runs:
                print(f"{shape:21s}  {kind:9s}  no run completed")
                continue
            counts = "/".join(str(sum(r[k] for r in runs)) for k in ("exact", "near_tie", "wrong"))
            shares = [r["bytes_second"] / r["bytes_first"] for r in runs if r["bytes_first"]]
            print(f"{shape:21s}  {kind:9s}  {_range([r['median_xfer_ms'] for r in runs]):20s}  "
                  f"{_range([r['median_ttft_ms'] for r in runs]):20s}  {counts:15s}  "
                  f"{_range(shares):13s}  {str(all(r['control'] for r in runs)) if args.control else '-':7s}  "
                  f"{max(r['max_xfer_ms'] or 0 for r in runs):11.2f}  {max(r['max_ttft_ms'] or 0 for r in runs):11.1f}  "
                  f"{sum(r['failed_loads'] for r in runs):6.0f}")
    print(f"\nPer run, first pass: failed loads, transfer median / p99 / max (ms), max/median (named at "
          f"{args.stall_ratio:g}x or more), load average (min-max)")
    for shape in args.shapes.split(","):
        for kind in kinds:
            runs = [r for r in results if r["shape"] == shape and r["kind"] == kind and "error" not in r]
            errors = sum(1 for r in results if r["shape"] == shape and r["kind"] == kind and "error" in r)
            if not runs:
                continue
            over = [r["round"] for r in runs if r["failed_loads"] > 0
                    or (r["max_over_median"] or 0) >= args.stall_ratio]
            ratios = [r["max_over_median"] for r in runs if r["max_over_median"] is not None]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "- (no transfer counted)"
            print(f"{shape:21s}  {kind:9s}  {len(runs)} runs ({errors} died), failed loads "
                  f"{sum(r['failed_loads'] for r in runs):.0f}, max/median {spread}, "
                  f"runs named: {over or 'none'}")
            for r in runs:
                loads = r["load_average"]
                print(f"    run {r['round']:2d}: failed {r['failed_loads']:.0f}  {_fmt(r['median_xfer_ms'])} / "
                      f"{_fmt(r['first_p99_xfer_ms'])} / {_fmt(r['first_max_xfer_ms'])}  "
                      f"{_fmt(r['max_over_median'])}x  load {_fmt(loads[0], 1)}-{_fmt(loads[2], 1)}  "
                      f"slowest: TTFT {_fmt(r.get('slowest_ttft_ms'), 1)} ms, machine stall beside it "
                      f"{_fmt(r['slowest_machine_stall_ms'], 1)} ms")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"command": sys.argv, "results": results}, indent=1))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
