"""The two sides of a benchmark session and the channel between them.

``serve`` runs on the decode host (or in a local process for loopback runs):
it accepts control connections and gives each its own spawned process, in
which one engine's ``Target`` lives for the whole session. The prefill side
runs ``initiator_main`` in a spawned process of its own, drives the session
through the control connection and reports to the command line's process
through a pipe: a tick per timed batch, a record per result.

Engine processes leave through ``os._exit``: some engines (NIXL with UCX)
crash in their own teardown at interpreter exit, and nothing of theirs
needs flushing. The control channel is ``multiprocessing.connection`` with
an HMAC key, and carries pickles: expose ``serve`` to trusted hosts only.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import importlib
import multiprocessing as mp
import os
import resource
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Optional

from .engines.base import PULL, Unavailable, label
from .layout import KiB, Layout, digest, fill

ENGINES = {"datadist_aio": "datadist", "raw_tcp": "raw_tcp", "mooncake": "mooncake", "nixl": "nixl"}
CONTROL_TIMEOUT = 300.0  # seconds any one control request may take (a 256 MiB digest, a slow engine start)
LATENCY_LAYOUT = Layout(tensors=1, blocks=1, block_size=4 * KiB)


def engine_module(engine: str) -> Any:
    return importlib.import_module(f".engines.{ENGINES[engine]}", __package__)


def _die_with_parent() -> None:
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RemoteError(RuntimeError):
    """The target side failed; the message carries its traceback."""


def _call(conn: Connection, *request: Any) -> Any:
    conn.send(request)
    if not conn.poll(CONTROL_TIMEOUT):
        raise TimeoutError(f"the target did not answer {request[0]!r} within {CONTROL_TIMEOUT:.0f} s")
    kind, value = conn.recv()
    if kind == "unavailable":
        raise Unavailable(value)
    if kind == "error":
        raise RemoteError(value)
    return value


# -- the target (decode) side -------------------------------------------------------


def link_secret(authkey: bytes) -> str:
    """The link secret both sides of a session derive from the control
    channel's key: engines that authenticate their links prove it to each
    other, and it never crosses the wire."""
    return hmac.new(authkey, b"datadist_aio.bench link secret", hashlib.sha256).hexdigest()


def _opened(target: Optional[Any]) -> Any:
    if target is None:
        raise ValueError("the session has no engine yet: 'open' comes first")
    return target


def _next_request(conn: Connection, target: Optional[Any]) -> bool:
    """Wait for the next request; false when none came in time. A target
    with ``drive()`` (an engine with no thread of its own) is driven meanwhile."""
    drive = getattr(target, "drive", None)
    if drive is None:
        return conn.poll(CONTROL_TIMEOUT * 4)
    deadline = time.monotonic() + CONTROL_TIMEOUT * 4
    while not conn.poll(0):
        drive()
        if time.monotonic() > deadline:
            return False
    return True


def _target_session(conn: Connection, host: str, authkey: bytes) -> None:
    _die_with_parent()
    target = None
    try:
        while _next_request(conn, target):
            request = conn.recv()
            command, args = request[0], request[1:]
            try:
                if command == "open":
                    engine, variant = args
                    target = engine_module(engine).Target({**variant, "link_secret": link_secret(authkey)}, host)
                    answer = target.open()
                elif command == "prepare":
                    answer = _opened(target).prepare(args[0])
                elif command == "fill":
                    fill(_opened(target).tensors(), args[0])
                    answer = None
                elif command == "digest":
                    answer = digest(_opened(target).tensors(), args[0])
                elif command == "cpu":
                    answer = time.process_time()
                elif command == "rusage":
                    answer = _rusage()
                elif command == "threads":
                    answer = thread_costs()
                elif command == "switches":
                    answer = context_switches()
                elif command == "close":
                    conn.send(("ok", None))
                    break
                else:
                    raise ValueError(f"unknown command {command!r}")
                conn.send(("ok", answer))
            except Unavailable as exc:
                conn.send(("unavailable", str(exc)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except (EOFError, OSError):
        pass
    finally:
        if target is not None:
            try:
                target.close()
            except Exception:
                pass
        os._exit(0)


def serve(host: str, port: int, authkey: bytes, ready: Optional[Connection] = None) -> None:
    """Accept control connections on host:port until terminated (SIGTERM or SIGINT)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = mp.get_context("spawn")
    sessions: list[Any] = []
    with Listener((host, port), authkey=authkey) as listener:
        if ready is not None:
            ready.send(listener.address)
            ready.close()
        else:
            print(f"datadist_aio.bench serving on {listener.address[0]}:{listener.address[1]}", flush=True)
        try:
            while True:
                try:
                    conn = listener.accept()
                except mp.AuthenticationError:
                    continue
                process = ctx.Process(target=_target_session, args=(conn, host, authkey), daemon=True)
                process.start()
                conn.close()
                sessions = [p for p in sessions if p.is_alive()] + [process]
        finally:
            for process in sessions:
                process.kill()
                process.join(5)


def check_peer(address: Any, authkey: bytes) -> None:
    """Connect once to a ``serve`` process; raises ConnectionError with the reason."""
    try:
        Client(address, authkey=authkey).close()
    except mp.AuthenticationError:
        raise ConnectionError(f"the benchmark server at {address[0]}:{address[1]} refused the key") from None
    except OSError as exc:
        raise ConnectionError(f"no benchmark server at {address[0]}:{address[1]}: {exc.strerror or exc}") from None


def start_local_server(host: str, authkey: bytes) -> tuple[Any, tuple[str, int]]:
    """A ``serve`` process on host (loopback runs); returns it and its address."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=serve, args=(host, 0, authkey, child), daemon=False)
    process.start()
    child.close()
    with parent:
        if not parent.poll(60):
            stop_local_server(process)
            raise TimeoutError("the local benchmark server did not start within 60 s")
        return process, parent.recv()


def stop_local_server(process: Any) -> None:
    process.terminate()
    process.join(15)
    if process.is_alive():
        process.kill()
        process.join(5)
    process.close()


# -- the initiator (prefill) side ---------------------------------------------------------


@dataclass
class Plan:
    """What one engine variant measures in one session."""

    engine: str
    variant: dict[str, Any]
    layouts: list[Layout]
    ops: list[str]
    iterations: int
    latency_ops: int = 0  # 0: no latency run
    idle_seconds: float = 0.0  # 0: no idle CPU reading
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or label(self.engine, self.variant)


@dataclass
class Result:
    engine: str
    variant: dict[str, Any]
    label: str
    op: str
    block_size: int
    blocks: int
    tensors: int
    bytes: int
    seconds: list[float] = field(default_factory=list)  # every timed batch, in order
    verified: bool = False

    @property
    def gbps(self) -> float:
        """Bytes per second of the median batch, in GB/s (as the memcpy baseline)."""
        return self.bytes / statistics.median(self.seconds) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


def initiator_main(report: Connection, address: Any, authkey: bytes, plan: Plan) -> None:
    """Run ``plan`` against the server at ``address``; report ticks and results on ``report``."""
    _die_with_parent()
    conn: Optional[Connection] = None
    initiator = None
    try:
        conn = Client(address, authkey=authkey)
        module = engine_module(plan.engine)
        opened = _call(conn, "open", plan.engine, plan.variant)
        initiator = module.Initiator({**plan.variant, "link_secret": link_secret(authkey)}, opened)
        seed = 1
        for layout in plan.layouts:
            initiator.prepare(layout, _call(conn, "prepare", layout))
            fill(initiator.tensors(), seed)
            table = list(range(layout.blocks)) if getattr(module.Initiator, "contiguous", False) else layout.table()
            for op in plan.ops:
                if op not in module.Initiator.ops:
                    continue
                seed += 1
                if op == PULL:
                    fill(initiator.tensors(), seed)  # the destination starts out different
                else:
                    _call(conn, "fill", seed)
                result = Result(plan.engine, plan.variant, plan.label, op, layout.block_size, layout.blocks,
                                 layout.tensors, layout.total_bytes)
                report.send(("phase", f"{plan.label}: {op} {size_text(layout.block_size)}"))
                for i in range(plan.iterations + 1):  # the first, untimed, also faults pages in
                    start = time.perf_counter()
                    initiator.batch(op, table)
                    if i:
                        result.seconds.append(time.perf_counter() - start)
                    report.send(("tick", 1))
                local = digest(initiator.tensors())
                remote = _call(conn, "digest", table)
                result.verified = local == remote
                report.send(("result", result))
        if plan.latency_ops:
            report.send(("phase", f"{plan.label}: 4 KiB latency"))
            initiator.prepare(LATENCY_LAYOUT, _call(conn, "prepare", LATENCY_LAYOUT))
            initiator.latency(max(10, plan.latency_ops // 10))  # warm-up
            fill(initiator.tensors(), seed + 1)
            _call(conn, "fill", seed + 2)
            remote_threads, local_threads = _call(conn, "threads"), thread_costs()
            remote_before, local_before = _call(conn, "rusage"), _rusage()
            remote_switches, local_switches = _call(conn, "switches"), context_switches()
            samples = initiator.latency(plan.latency_ops)
            local_switches = context_switches() - local_switches
            remote_switches = _call(conn, "switches") - remote_switches
            local_after, remote_after = _rusage(), _call(conn, "rusage")
            threads = {"initiator": thread_delta(local_threads, thread_costs()),
                       "target": thread_delta(remote_threads, _call(conn, "threads"))}
            costs = {name: (local_after[name] - local_before[name]) + (remote_after[name] - remote_before[name])
                     for name in local_before}
            verified = digest(initiator.tensors()) == _call(conn, "digest", [0])
            measured = {"engine": plan.engine, "variant": plan.variant, "label": plan.label, "seconds": samples,
                        "verified": verified, "costs": costs, "threads": threads,
                        "switches": {"initiator": local_switches, "target": remote_switches}}
            if hasattr(initiator, "submit_seconds"):
                measured["submit_seconds"] = initiator.submit_seconds
            if hasattr(initiator, "submit_parts"):
                measured["submit_parts"] = initiator.submit_parts(plan.latency_ops)
            report.send(("latency", measured))
            report.send(("tick", 1))
        if plan.idle_seconds:
            report.send(("phase", f"{plan.label}: idle CPU"))
            report.send(("idle", _idle_cpu(conn, plan)))
        initiator.close()
        initiator = None
        _call(conn, "close")
        report.send(("done", None))
    except Unavailable as exc:
        report.send(("unavailable", str(exc)))
    except BaseException:
        report.send(("error", traceback.format_exc()))
    finally:
        if initiator is not None:
            try:
                initiator.close()
            except Exception:
                pass
        if conn is not None:
            conn.close()
        report.close()
        os._exit(0)


def _rusage() -> dict[str, float]:
    """This process's context switches and CPU time so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"voluntary_switches": usage.ru_nvcsw, "involuntary_switches": usage.ru_nivcsw,
            "cpu_seconds": usage.ru_utime + usage.ru_stime}


def context_switches() -> int:
    """Context switches so far, voluntary and involuntary, of this process's
    threads alive now (/proc/self/task/*/status); getrusage's figure for the
    whole process where /proc has none."""
    total, found = 0, False
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f
                             if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
            found = True
        except (OSError, ValueError):
            continue  # the thread has gone
    if found:
        return total
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def thread_costs() -> dict[str, dict[str, int]]:
    """CPU nanoseconds and voluntary switches so far of this process's threads,
    summed by name ("main" for the main thread; the engine names its threads
    dd-io, dd-keeper, ...). Empty where /proc has no per-thread figures."""
    out: dict[str, dict[str, int]] = {}
    pid = os.getpid()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "main" if int(tid) == pid else f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu_ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, ValueError, StopIteration):
            continue  # the thread has gone
        entry = out.setdefault(name, {"cpu_ns": 0, "switches": 0, "threads": 0})
        entry["cpu_ns"] += cpu_ns
        entry["switches"] += switches
        entry["threads"] += 1
    return out


def thread_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What each thread name spent between two ``thread_costs`` readings."""
    zero = {"cpu_ns": 0, "switches": 0}
    return {name: {"cpu_ns": now["cpu_ns"] - before.get(name, zero)["cpu_ns"],
                   "switches": now["switches"] - before.get(name, zero)["switches"], "threads": now["threads"]}
            for name, now in after.items()}


def _idle_cpu(conn: Connection, plan: Plan) -> dict[str, Any]:
    """CPU each side's process burns while connected and idle, in percent of one core."""
    remote = _call(conn, "cpu")
    local = time.process_time()
    time.sleep(plan.idle_seconds)
    local = time.process_time() - local
    remote = _call(conn, "cpu") - remote
    return {"label": plan.label, "seconds": plan.idle_seconds,
            "initiator_percent": 100 * local / plan.idle_seconds, "target_percent": 100 * remote / plan.idle_seconds}


def size_text(nbytes: int) -> str:
    if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes >> 10} KiB" if nbytes % 1024 == 0 else f"{nbytes} B"
