"""Command line of the benchmark.

    python -m datadist_aio.bench [--quick] [--output DIR] [--compare] ...
    python -m datadist_aio.bench --ucx [--quick] [--output DIR] ...
    python -m datadist_aio.bench serve --listen IP:PORT --authkey KEY
    python -m datadist_aio.bench --device [--quick] [--output DIR] [--driver PATH] ...
    python -m datadist_aio.bench --encryption [--quick] [--output DIR] ...
    python -m datadist_aio.bench --access [--quick] [--output DIR] ...

The first form measures; with ``--peer IP:PORT`` its target side is a
``serve`` process on another host, otherwise one it starts on loopback.
``--ucx`` measures this library on transport "ucx" against NIXL's UCX
backend instead, on the same UCX transports.
The third measures device-memory transfers on one GPU (bench/device.py);
the fourth, encrypted links against plain ones (bench/encryption.py); the
fifth, one-sided access against owner-served transfers on one host, with
the owner's host quiet and busy (bench/access.py).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

from .arguments import address, bounded, byte_size, listed, positive
from .engines.base import LAYERWISE, PULL, PUSH, UCX_TLS
from .loops import LOOPS, available_loops
from .progress import Progress
from .runner import COMPARED, Options, Outcome, build_report, memcpy_baseline, plans, run_plan, steps
from .session import check_peer, serve, start_local_server, stop_local_server

AUTHKEY_ENV = "DATADIST_BENCH_AUTHKEY"


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m datadist_aio.bench",
        description="Throughput and latency of KV-cache transfers between two processes, with raw TCP and memcpy "
        "baselines measured in the same run. Writes DIR/datadist_bench.json and, with matplotlib, "
        "DIR/datadist_bench.png. Run 'python -m datadist_aio.bench serve -h' for the remote target side.")
    p.add_argument("--quick", action="store_true", help="a run of under a minute: 64 MiB cache, 3 batches, 300 latency ops")
    p.add_argument("--output", type=Path, metavar="DIR", default=Path("bench-results"), help="directory for the JSON and PNG (default: %(default)s)")
    p.add_argument("--cache-size", type=byte_size, metavar="SIZE", help="bytes moved per batch (default 256M; quick 64M)")
    p.add_argument("--block-sizes", type=listed(byte_size), metavar="SIZES", help="block sizes per tensor (default 16K,256K,4M)")
    p.add_argument("--layers", type=positive, default=4, help="layers of the cache, K and V each (default: %(default)s)")
    p.add_argument("--ops", type=listed(str, [PUSH, PULL, LAYERWISE]),
                   help="operations (default: push,pull,layerwise; with --ucx push,pull; the other engines do push and pull)")
    p.add_argument("--loop", type=listed(str, LOOPS), help="event loops to await on (default: each installed; with --ucx asyncio)")
    p.add_argument("--iterations", type=positive, help="timed batches per measurement (default 7; quick 3)")
    p.add_argument("--latency-ops", type=bounded(int, 0), help="4 KiB writes in the latency run, 0 for none (default 2000; quick 300)")
    p.add_argument("--idle", type=bounded(float, 0, 3600), metavar="SECONDS",
                   help="read each engine's CPU use while connected and idle for this long, 0 for none (default 2; quick 1)")
    p.add_argument("--streams", type=listed(positive), help="raw TCP stream counts (default 1,2,4; with --ucx 1)")
    p.add_argument("--connections", type=positive, help="datadist_aio TCP connections per peer (default: the library's)")
    p.add_argument("--transport", type=listed(str, ["auto", "tcp"]),
                   help="datadist_aio transports to measure: auto (kernel copies on one host) and/or tcp (default: both)")
    p.add_argument("--compare", nargs="?", const=list(COMPARED), type=listed(str, COMPARED), default=[],
                   metavar="ENGINES", help="also measure these engines where installed: mooncake, nixl (default: both; "
                   "pip install 'datadist_aio[compare]')")
    p.add_argument("--ucx", action="store_true", help="the UCX comparison instead of the engines above: this library on "
                   "transport ucx and NIXL's UCX backend, no progress thread on either, with the baselines")
    p.add_argument("--ucx-tls", type=listed(str, list(UCX_TLS)), default=list(UCX_TLS), metavar="TLS",
                   help="UCX transports of --ucx: tcp (UCX_TLS=tcp) and/or shm (UCX_TLS=shm,self,tcp) "
                   "(default: both)")
    p.add_argument("--peer", type=address, metavar="IP:PORT", help="the IP:PORT of a 'serve' process on the decode host (default: one on loopback)")
    p.add_argument("--authkey", help=f"the serve process's key (default: ${AUTHKEY_ENV}; a fresh one on loopback)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds without progress before a session is given up")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--device", action="store_true", help="the device benchmark instead, on one GPU: its own options "
                   "(python -m datadist_aio.bench --device -h)")
    p.add_argument("--encryption", action="store_true", help="the link encryption benchmark instead: TLS against "
                   "plain links on loopback (python -m datadist_aio.bench --encryption -h)")
    p.add_argument("--access", action="store_true", help="the access benchmark instead: one-sided against "
                   "owner-served transfers on one host (python -m datadist_aio.bench --access -h)")
    return p


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m datadist_aio.bench serve",
        description="The decode (target) side for runs from another host: one process per session, each engine's "
        "data plane bound to the listen IP. The control channel carries pickles behind an HMAC key: expose it to "
        "trusted hosts only.")
    p.add_argument("--listen", type=address, metavar="IP:PORT", default=("127.0.0.1", 7400), help="IP:PORT (default 127.0.0.1:7400)")
    p.add_argument("--authkey", help=f"shared key (default: ${AUTHKEY_ENV})")
    return p


def _authkey(given: str | None, required: bool) -> bytes:
    key = given or os.environ.get(AUTHKEY_ENV)
    if key:
        return key.encode()
    if required:
        sys.exit(f"error: give --authkey or set {AUTHKEY_ENV}")
    return secrets.token_bytes(16)


def options_from(args: argparse.Namespace) -> Options:
    quick, ucx = args.quick, args.ucx
    return Options(
        cache_bytes=args.cache_size or ((64 if quick else 256) << 20),
        block_sizes=args.block_sizes or [16 << 10, 256 << 10, 4 << 20],
        layers=args.layers,
        ops=args.ops or ([PUSH, PULL] if ucx else [PUSH, PULL, LAYERWISE]),
        loops=args.loop or (["asyncio"] if ucx else available_loops()),
        iterations=args.iterations or (3 if quick else 7),
        latency_ops=args.latency_ops if args.latency_ops is not None else (300 if quick else 2000),
        idle_seconds=args.idle if args.idle is not None else (1.0 if quick else 2.0),
        streams=args.streams or ([1] if ucx else [1, 2, 4]),
        connections=args.connections,
        transports=args.transport or ["auto", "tcp"],
        compare=args.compare,
        ucx_tls=args.ucx_tls if ucx else [],
        timeout=args.timeout,
    )


def run(argv: list[str]) -> int:
    parser = run_parser()
    args = parser.parse_args(argv)
    if args.ucx and (args.compare or args.transport or args.connections):
        parser.error("--ucx measures its own pair of engines: leave out --compare, --transport and --connections")
    options = options_from(args)
    try:
        plan_list = plans(options)
    except ValueError as exc:
        parser.error(str(exc))
    if "uvloop" in options.loops and "uvloop" not in available_loops():
        parser.error("uvloop is not installed (pip install 'datadist_aio[uvloop]')")
    args.output.mkdir(parents=True, exist_ok=True)
    authkey = _authkey(args.authkey, required=args.peer is not None)
    server = None
    if args.peer is None:
        server, peer_address = start_local_server("127.0.0.1", authkey)
        peer = "loopback"
    else:
        peer_address, peer = args.peer, f"{args.peer[0]}:{args.peer[1]}"
        try:
            check_peer(peer_address, authkey)
        except ConnectionError as exc:
            print(f"error: {exc} (start one there with 'python -m datadist_aio.bench serve')", file=sys.stderr)
            return 1
    outcome = Outcome()
    progress = Progress(sum(steps(p) for p in plan_list) + 1)
    try:
        progress.set_phase("memcpy baseline")
        memcpy = memcpy_baseline(options.cache_bytes, options.iterations)
        progress.advance()
        for plan in plan_list:
            run_plan(plan, peer_address, authkey, progress, options.timeout, outcome)
    finally:
        progress.close()
        if server is not None:
            stop_local_server(server)
    report = build_report(options, outcome, memcpy, peer, ["python", "-m", "datadist_aio.bench", *argv])
    json_path = args.output / "datadist_bench.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    from .report import plot, tables

    print(tables(report))
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        try:
            png = args.output / "datadist_bench.png"
            plot(report, png)
            print(f"wrote {png}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install 'datadist_aio[bench]')")
    wrong = [r for r in report["results"] if not r["verified"]] + [r for r in report["latency"] if not r["verified"]]
    return 1 if report["errors"] or wrong else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        args = serve_parser().parse_args(argv[1:])
        try:
            serve(args.listen[0], args.listen[1], _authkey(args.authkey, required=True))
        except KeyboardInterrupt:
            pass
        return 0
    if "--device" in argv:
        from .device import main as device_main

        return device_main(argv)
    if "--encryption" in argv:
        from .encryption import main as encryption_main

        return encryption_main(argv)
    if "--access" in argv:
        from .access import main as access_main

        return access_main(argv)
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
