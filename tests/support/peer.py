"""A datadist_aio endpoint in a child process, driven from the test over a Pipe.

The parent sends ``(command, args, kwargs)``; the child runs the function that
``_COMMANDS`` names and answers ``("ok", result)`` or ``("error", exception,
traceback)``. An exception comes back as the same kind (``LLMException`` keeps
its status code) and is raised again in the parent, with the child's
traceback as a note. Every command has a deadline: a peer that misses it is
killed and ``PeerTimeout`` is raised, so a hung engine cannot hang the run.

Caches stay in the child; the parent holds ``CacheRef``s, which the child
turns back into its ``Cache`` objects wherever one appears as an argument.
Children are started with the spawn method, listen on loopback only, and die
with the parent (``PR_SET_PDEATHSIG``) if it is killed before it can close
them.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import re
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NamedTuple, Optional

import numpy as np
import pytest

import datadist_aio as dd
from support.cache_bytes import tensor_bytes

__all__ = [
    "HAVE_UVLOOP",
    "LOOPBACK",
    "MiB",
    "CacheRef",
    "Peer",
    "PeerError",
    "PeerGroup",
    "PeerTimeout",
    "cluster_info",
    "free_port",
    "pool_cfg",
    "raises_status",
    "seeded_tensors",
    "main_thread_sleeps",
    "unread_socket_bytes",
    "wait_until",
]

LOOPBACK = "127.0.0.1"
# A link or unlink that succeeds does so in milliseconds; its deadline is
# generous for a loaded machine (a test that means a timeout names its own).
LINK_TIMEOUT_MS = 20000
MiB = 1 << 20
HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
# Whether links can take transport "ucx" here (the UCX plugin and UCX load).
HAVE_UCX, UCX_WHY = dd._native.ucx_available()


def ucx_names_transports() -> bool:
    """Whether the UCX loaded here names an endpoint's transports (1.14 on),
    which one-sided access over UCX needs."""
    found = re.match(r"UCX (\d+)\.(\d+)", UCX_WHY)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= (1, 14)
_SPAWN = multiprocessing.get_context("spawn")
# Spawning starts multiprocessing's resource tracker once per process and keeps
# a descriptor to it; starting it now keeps it out of the per-test fd check.
multiprocessing.resource_tracker.ensure_running()


def pool_cfg(memory_size: int) -> str:
    """``host_mem_pool_cfg`` for a host pool of ``memory_size`` bytes."""
    return f'{{"memory_size": {memory_size}}}'


DEFAULT_OPTIONS: dict[str, Any] = {
    "enable_cache_manager": True,
    "enable_remote_cache_accessible": True,
    "host_mem_pool_cfg": pool_cfg(64 * MiB),
    "sync_kv_timeout": 5000,
}


def seeded_tensors(desc: dd.CacheDesc, seed: int) -> list[np.ndarray]:
    """The bytes ``Peer.fill(ref, seed)`` writes: one flat uint8 array per tensor."""
    rng = np.random.default_rng(seed)
    return [np.frombuffer(rng.bytes(desc.size), dtype=np.uint8) for _ in range(desc.num_tensors)]


def cluster_info(
    cluster_id: int, port: Optional[int], host: str = LOOPBACK, local: str = LOOPBACK
) -> dd.LLMClusterInfo:
    """The peer ``cluster_id`` listening on ``host``:``port`` (no remote address
    if ``port`` is None), reached from the local address ``local``."""
    info = dd.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info(local, 0)
    if port is not None:
        info.append_remote_ip_info(host, port)
    return info


def free_port() -> int:
    """A loopback port nobody listens on (free when this returns)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class _RaisesStatus:
    def __init__(self, codes: tuple[dd.LLMStatusCode, ...]) -> None:
        self.codes = codes
        self.value: Optional[dd.LLMException] = None

    def __enter__(self) -> "_RaisesStatus":
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Optional[TracebackType]) -> bool:
        names = " or ".join(code.name for code in self.codes)
        if exc is None:
            raise AssertionError(f"LLMException({names}) was not raised")
        if not isinstance(exc, dd.LLMException):
            return False
        assert exc.status_code in self.codes, f"expected {names}, got {exc!r}"
        self.value = exc
        return True


def raises_status(*codes: dd.LLMStatusCode) -> _RaisesStatus:
    """Like ``pytest.raises(LLMException)``, also checking the status is one of
    ``codes``; the exception is in ``.value`` afterwards."""
    return _RaisesStatus(codes)


class CacheRef(NamedTuple):
    """A cache living in a peer: the owner's cluster id, the cache's id and geometry."""

    cluster_id: int
    cache_id: int
    desc: dd.CacheDesc
    blocks: bool
    model_id: Optional[int] = None

    def key(self, batch_index: int = 0) -> dd.CacheKeyByIdAndIndex:
        """The key a linked process uses to reach batch slot ``batch_index`` of this cache."""
        return dd.CacheKeyByIdAndIndex(self.cluster_id, self.cache_id, batch_index)

    def blocks_key(self) -> dd.BlocksCacheKey:
        """The key a linked process uses to reach this blocks cache by its model id."""
        assert self.model_id is not None, f"cache {self.cache_id} was not bound to a model id"
        return dd.BlocksCacheKey(self.cluster_id, self.model_id)


class PeerError(RuntimeError):
    """The peer process failed: it died, was killed, or is not running."""


class PeerTimeout(PeerError):
    """A command got no answer in time; the peer has been killed."""


# -- child side -------------------------------------------------------------------


class _Endpoint:
    """What the child holds: its LLMDataDist, caches, started tasks, event loop."""

    def __init__(
        self, role: dd.LLMRole, cluster_id: int, listen: bool, options: dict[str, Any], loop: str, host: str
    ) -> None:
        config = dd.LLMConfig()
        listen_options = {"listen_ip_info": f"{host}:0"} if listen else {}
        for name, value in {**DEFAULT_OPTIONS, **listen_options, **options}.items():
            setattr(config, name, value)
        if options.get("transport") == "ucx" and os.environ.get("DATADIST_AIO_LINK_ENCRYPTION") == "tls":
            # A run with link encryption on (the environment's) keeps its UCX
            # cases: those peers opt in to unencrypted UCX by name.
            config.allow_unencrypted_ucx = True
        if loop == "uvloop":
            import uvloop

            self.loop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.cluster_id = cluster_id
        self.host = host
        self.datadist = dd.LLMDataDist(role, cluster_id)
        self.datadist.init(config.generate_options())
        self.cm = self.datadist.cache_manager
        self.caches: dict[int, tuple[dd.Cache, bool]] = {}  # id -> (cache, registered)
        self.tasks: dict[int, dd.CacheTask] = {}

    def resolve(self, value: Any) -> Any:
        if not isinstance(value, CacheRef):
            return value
        if value.cluster_id != self.cluster_id:
            raise PeerError(f"{value} belongs to cluster {value.cluster_id}, not to this peer ({self.cluster_id})")
        if value.cache_id not in self.caches:
            raise PeerError(f"no cache {value.cache_id} here: it was freed or never made by this harness")
        return self.caches[value.cache_id][0]

    def call(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        args = [self.resolve(a) for a in args]
        kwargs = {k: self.resolve(v) for k, v in kwargs.items()}
        return getattr(self.cm, method)(*args, **kwargs)

    async def awaited(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        return await self.call(f"{method}_async", args, kwargs)

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def keep(self, cache: dd.Cache, registered: bool, model_id: Optional[int]) -> CacheRef:
        self.caches[cache.cache_id] = (cache, registered)
        return CacheRef(self.cluster_id, cache.cache_id, cache.cache_desc, cache.is_blocks_cache, model_id)

    def free(self, cache_id: int) -> None:
        cache, registered = self.caches.pop(cache_id)
        if registered:
            self.cm.unregister_cache(cache_id)
        elif cache.is_blocks_cache:
            self.cm.deallocate_blocks_cache(cache)
        else:
            self.cm.deallocate_cache(cache)


_COMMANDS: dict[str, Callable[..., Any]] = {}


def _command(function: Callable[..., Any]) -> Callable[..., Any]:
    _COMMANDS[function.__name__.lstrip("_")] = function
    return function


@_command
def _listen_port(ep: _Endpoint) -> Optional[int]:
    return ep.datadist.listen_port


@_command
def _allocate(
    ep: _Endpoint, desc: dd.CacheDesc, blocks: bool, keys: Sequence[dd.CacheKey], model_id: Optional[int]
) -> CacheRef:
    if blocks:
        key = None if model_id is None else dd.BlocksCacheKey(ep.cluster_id, model_id)
        return ep.keep(ep.cm.allocate_blocks_cache(desc, key), False, model_id)
    return ep.keep(ep.cm.allocate_cache(desc, list(keys)), False, None)


@_command
def _register(
    ep: _Endpoint,
    desc: dd.CacheDesc,
    blocks: bool,
    keys: Sequence[dd.CacheKey],
    model_id: Optional[int],
    remote_accessible: Optional[bool],
) -> CacheRef:
    arrays = [np.zeros(desc.shape, dtype=desc.data_type.numpy_dtype) for _ in range(desc.num_tensors)]
    if blocks:
        key = None if model_id is None else dd.BlocksCacheKey(ep.cluster_id, model_id)
        return ep.keep(ep.cm.register_blocks_cache(desc, arrays, key, remote_accessible), True, model_id)
    return ep.keep(ep.cm.register_cache(desc, arrays, list(keys), remote_accessible), True, None)


@_command
def _free(ep: _Endpoint, ref: CacheRef) -> None:
    ep.resolve(ref)
    ep.free(ref.cache_id)


@_command
def _free_all(ep: _Endpoint) -> None:
    for cache_id in list(ep.caches):
        ep.free(cache_id)


@_command
def _fill(ep: _Endpoint, ref: CacheRef, seed: int) -> None:
    cache = ep.resolve(ref)
    for t, data in enumerate(seeded_tensors(cache.cache_desc, seed)):
        tensor_bytes(cache, t)[:] = data


@_command
def _read(ep: _Endpoint, ref: CacheRef, tensor: Optional[int]) -> Any:
    cache = ep.resolve(ref)
    if tensor is not None:
        return tensor_bytes(cache, tensor).copy()
    return [tensor_bytes(cache, t).copy() for t in range(cache.cache_desc.num_tensors)]


@_command
def _tensor_addrs(ep: _Endpoint, ref: CacheRef) -> list[int]:
    return list(ep.resolve(ref).tensor_addrs)


@_command
def _link(ep: _Endpoint, cluster_id: int, port: Optional[int], timeout: int, host: str = LOOPBACK) -> Any:
    return ep.datadist.link_clusters([cluster_info(cluster_id, port, host, ep.host)], timeout)


@_command
def _unlink(
    ep: _Endpoint, cluster_id: int, port: Optional[int], timeout: int, force: bool, host: str = LOOPBACK
) -> Any:
    return ep.datadist.unlink_clusters([cluster_info(cluster_id, port, host, ep.host)], timeout, force)


@_command
def _datadist(ep: _Endpoint, method: str, *args: Any, **kwargs: Any) -> Any:
    return getattr(ep.datadist, method)(*args, **kwargs)


@_command
def _engine(ep: _Endpoint, method: str, *args: Any) -> Any:
    return getattr(ep.datadist._engine, method)(*args)


@_command
def _set_rlimit(ep: _Endpoint, name: str, soft: Optional[int]) -> tuple[int, int]:
    which = getattr(resource, name)
    hard = resource.getrlimit(which)[1]
    resource.setrlimit(which, (hard if soft is None else soft, hard))
    return resource.getrlimit(which)


@_command
def _cm(ep: _Endpoint, method: str, *args: Any, **kwargs: Any) -> Any:
    return ep.call(method, args, kwargs)


@_command
def _cm_async(ep: _Endpoint, method: str, *args: Any, **kwargs: Any) -> Any:
    return ep.run(ep.awaited(method, args, kwargs))


@_command
def _stream(ep: _Endpoint, method: str, *args: Any, **kwargs: Any) -> None:
    """Calls ``CacheManager.<method>`` over and over on a thread of its own
    until ``stream_stop``, counting the outcomes by status name."""
    assert getattr(ep, "streaming", None) is None, "a stream runs already"
    stop = threading.Event()
    counts: dict[str, int] = {}

    def loop() -> None:
        while not stop.is_set():
            try:
                ep.call(method, args, kwargs)
                name = "LLM_SUCCESS"
            except dd.LLMException as exc:
                name = exc.status_code.name
            counts[name] = counts.get(name, 0) + 1

    thread = threading.Thread(target=loop, name="stream", daemon=True)
    ep.streaming = (thread, stop, counts)  # type: ignore[attr-defined]
    thread.start()


@_command
def _stream_counts(ep: _Endpoint) -> dict[str, int]:
    return dict(ep.streaming[2])  # type: ignore[attr-defined]


@_command
def _stream_stop(ep: _Endpoint) -> dict[str, int]:
    thread, stop, counts = ep.streaming  # type: ignore[attr-defined]
    stop.set()
    thread.join(30)
    assert not thread.is_alive(), "the stream did not stop"
    ep.streaming = None  # type: ignore[attr-defined]
    return dict(counts)


@_command
def _renew(ep: _Endpoint, ref: CacheRef, seed: int) -> tuple[CacheRef, bool]:
    """Frees an allocated cache and at once allocates one like it and fills
    it: the new cache, and whether it lies where the old one did."""
    data = seeded_tensors(ref.desc, seed)  # ready before the free: the new cache is filled at once
    before = _tensor_addrs(ep, ref)
    ep.free(ref.cache_id)
    renewed = _allocate(ep, ref.desc, ref.blocks, [], ref.model_id)
    cache = ep.resolve(renewed)
    for t, tensor in enumerate(data):
        tensor_bytes(cache, t)[:] = tensor
    return renewed, _tensor_addrs(ep, renewed) == before


@_command
def _gather(
    ep: _Endpoint, method: str, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]], return_exceptions: bool
) -> Any:
    async def everything() -> list[Any]:
        return await asyncio.gather(
            *(ep.awaited(method, args, kwargs) for args, kwargs in calls), return_exceptions=return_exceptions
        )

    return ep.run(everything())


@_command
def _start_task(ep: _Endpoint, method: str, *args: Any, **kwargs: Any) -> int:
    task = ep.call(f"{method}_async", args, kwargs)
    handle = len(ep.tasks) + 1
    ep.tasks[handle] = task
    return handle


@_command
def _start_task_looked(ep: _Endpoint, method: str, *args: Any, **kwargs: Any) -> tuple[int, bool]:
    task = ep.call(f"{method}_async", args, kwargs)
    handle = len(ep.tasks) + 1
    ep.tasks[handle] = task
    return handle, task.done()


@_command
def _task_done(ep: _Endpoint, handle: int) -> bool:
    return ep.tasks[handle].done()


@_command
def _wait_task(ep: _Endpoint, handle: int) -> Any:
    async def wait() -> Any:
        return await ep.tasks[handle]

    return ep.run(wait())


WAIT_STYLES = ("await", "synchronize", "poll", "poll_results", "poll_in_loop", "callback", "callback_in_loop",
               "blocking_in_loop")


def _wait_in_style(ep: _Endpoint, task: dd.CacheTask, style: str) -> str:
    """Waits for ``task`` the way ``style`` says; the name of the thread a callback ran on, else ""."""
    if style == "await":
        ep.run(_awaited_task(task))
    elif style == "synchronize":
        task.synchronize()
    elif style == "poll":  # this thread runs no loop (the endpoint's loop is not running)
        while not task.done():
            time.sleep(0.001)
    elif style == "poll_results":
        while task.get_results(0)[0] is dd.LLMStatusCode.LLM_TIMEOUT:
            time.sleep(0.001)
    elif style == "poll_in_loop":
        ep.run(_polled_in_loop(task))
    elif style == "callback":  # registered from a thread with no running loop
        ran: list[str] = []
        called = threading.Event()
        task.add_done_callback(lambda t: (ran.append(threading.current_thread().name), called.set()))
        if not called.wait(30):
            raise PeerError("the done-callback was not called within 30 s")
        return ran[0]
    elif style == "callback_in_loop":
        return str(ep.run(_callback_in_loop(task)))
    elif style == "blocking_in_loop":  # a blocking call on the thread of a running loop, as in a notebook cell
        ep.run(_blocking_in_loop(task))
    else:
        raise ValueError(style)
    return ""


async def _awaited_task(task: dd.CacheTask) -> Any:
    return await task


async def _polled_in_loop(task: dd.CacheTask) -> None:
    while not task.done():
        await asyncio.sleep(0.001)


async def _callback_in_loop(task: dd.CacheTask) -> str:
    ran: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task.add_done_callback(lambda t: ran.set_result(threading.current_thread().name))
    return await asyncio.wait_for(ran, 30)


async def _blocking_in_loop(task: dd.CacheTask) -> None:
    task.synchronize()


@_command
def _cm_waited(ep: _Endpoint, style: str, method: str, *args: Any, **kwargs: Any) -> tuple[Any, str]:
    """Starts ``method_async`` and waits for it in ``style`` (``WAIT_STYLES``):
    its outcome as ``await`` gives it, and the thread a callback ran on."""
    task = ep.call(f"{method}_async", args, kwargs)
    where = _wait_in_style(ep, task, style)
    return task.result(), where


@_command
def _close(ep: _Endpoint) -> None:
    ep.datadist.finalize()
    ep.loop.close()


def deny_memory_access() -> None:
    """Makes the kernel refuse cross-process copies with this process where it
    can: drops CAP_SYS_PTRACE (a root peer's memory is then out of reach) and
    turns the process non-dumpable (an unprivileged peer cannot reach it)."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    cap_sys_ptrace = 1 << 19
    data[0].effective &= ~cap_sys_ptrace
    data[0].permitted &= ~cap_sys_ptrace
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    pr_set_dumpable = 4
    if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")


def run_unprivileged() -> None:
    """Drops root for the user nobody, so that per-user limits (RLIMIT_NPROC)
    apply to the child: the kernel does not hold root to them."""
    if os.geteuid() == 0:
        # Modules the commands load late, while the interpreter's files may
        # be readable by root only.
        np.random.default_rng(0)
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        _die_with_parent()  # a change of user clears the parent-death signal


_PREPARE: dict[str, Callable[[], None]] = {
    "deny_memory_access": deny_memory_access,
    "run_unprivileged": run_unprivileged,
}


def _die_with_parent() -> None:
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _answer_error(conn: multiprocessing.connection.Connection, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = PeerError(f"{type(exc).__name__}: {exc}")
    conn.send(("error", exc, text))


def rdma_here() -> bool:
    """Whether this host has an RDMA device (``/sys/class/infiniband``)."""
    folder = "/sys/class/infiniband"
    return os.path.isdir(folder) and any(not name.startswith(".") for name in os.listdir(folder))


def ucx_loopback_devices() -> Optional[str]:
    """``UCX_NET_DEVICES`` for a UCX end on loopback: ``lo`` where the host has
    no RDMA device (where it has one, UCX's own choice). A UCX worker's
    address names every interface up when it starts, the veths of other
    tests' namespaces too (those of a test before, or of a run alongside),
    and Debian 12's UCX (1.13) moves a link's bytes over each: once such a
    veth is deleted, every operation on the link times out."""
    return None if rdma_here() else "lo"


def _ucx_on_the_device_of(host: str) -> None:
    """Names the interface that holds ``host`` in ``UCX_NET_DEVICES`` (unless
    set already), as an operator does on a host with several networks: Debian
    12's UCX (1.13) does not check that a peer's TCP address is reachable from
    a device (the libucx-cu12 wheel's 1.22 does), so with a second namespace's
    veth on this side it may pick that one and fail the link with "Network is
    unreachable". Loopback peers get ``ucx_loopback_devices()``."""
    if "UCX_NET_DEVICES" in os.environ:
        return
    if host == LOOPBACK:
        devices = ucx_loopback_devices()
        if devices is not None:
            os.environ["UCX_NET_DEVICES"] = devices
        return
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
    for line in shown.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "inet" and fields[3].split("/")[0] == host:
            os.environ["UCX_NET_DEVICES"] = fields[1].split("@")[0]
            return


def _child_main(
    conn: multiprocessing.connection.Connection,
    role: dd.LLMRole,
    cluster_id: int,
    listen: bool,
    options: dict[str, Any],
    loop: str,
    prepare: Optional[str],
    host: str = LOOPBACK,
) -> None:
    _die_with_parent()
    try:
        _ucx_on_the_device_of(host)
        if prepare is not None:
            _PREPARE[prepare]()
        endpoint = _Endpoint(role, cluster_id, listen, options, loop, host)
    except BaseException as exc:
        _answer_error(conn, exc)
        return
    conn.send(("ok", None))
    while True:
        try:
            command, args, kwargs = conn.recv()
        except EOFError:  # the parent is gone
            endpoint.datadist.finalize()
            return
        try:
            result = _COMMANDS[command](endpoint, *args, **kwargs)
        except BaseException as exc:
            _answer_error(conn, exc)
        else:
            try:
                conn.send(("ok", result))
            except Exception as exc:  # an unpicklable result
                _answer_error(conn, exc)
        if command == "close":
            return


# -- parent side ------------------------------------------------------------------


class Peer:
    """A datadist_aio endpoint in a child process; a context manager that closes it.

    Args:
        name: Shown in messages.
        command_timeout: Seconds any command may take before the peer is
            killed and ``PeerTimeout`` raised.
    """

    def __init__(self, name: str = "peer", command_timeout: float = 30.0) -> None:
        self.name = name
        self.command_timeout = command_timeout
        self.cluster_id: Optional[int] = None
        self.address = LOOPBACK  # where it listens, and the local address of the links it opens
        self._process: Optional[Any] = None
        self._conn: Optional[multiprocessing.connection.Connection] = None
        self._stopped = False
        self._dead = False

    def __repr__(self) -> str:
        pid = self._process.pid if self._process is not None else None
        return f"<Peer {self.name} cluster_id={self.cluster_id} pid={pid}>"

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def pid(self) -> int:
        assert self._process is not None and self._process.pid is not None, f"{self!r} was not started"
        return self._process.pid

    # -- life cycle

    def start(
        self,
        role: dd.LLMRole,
        cluster_id: int,
        listen: bool = True,
        options: Optional[dict[str, Any]] = None,
        loop: str = "asyncio",
        prepare: Optional[str] = None,
        host: str = LOOPBACK,
    ) -> "Peer":
        """Starts the child and initialises its LLMDataDist; returns ``self``.

        Args:
            role: Role of the instance.
            cluster_id: Its cluster id.
            listen: Whether it listens (on ``127.0.0.1``, a free port).
            options: ``LLMConfig`` attribute values over ``DEFAULT_OPTIONS``
                (RCA mode, a 64 MiB host pool, ``sync_kv_timeout`` 5000).
            loop: Event loop of the async commands: ``"asyncio"`` or ``"uvloop"``.
            prepare: A function the child runs before anything else, by its
                name in ``_PREPARE`` (``"deny_memory_access"``).
            host: The address it listens on and opens its links from.
        """
        assert self._process is None, f"{self!r} was already started"
        self.cluster_id = cluster_id
        self.address = host
        self._process, self._conn = self._spawn((role, cluster_id, listen, dict(options or {}), loop, prepare, host))
        try:
            self._answer("start", self.command_timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, args: tuple[Any, ...]) -> tuple[Any, multiprocessing.connection.Connection]:
        """Starts the child running ``_child_main(conn, *args)``: the process
        (as ``multiprocessing.Process``) and the parent's end of the pipe."""
        parent_end, child_end = _SPAWN.Pipe()
        process = _SPAWN.Process(target=_child_main, args=(child_end, *args), name=f"peer-{self.name}", daemon=True)
        process.start()
        child_end.close()
        return process, parent_end

    def close(self, timeout: float = 10.0) -> Optional[int]:
        """Finalizes the child, joins it (killing it after ``timeout`` s), returns its exit code.

        Safe to call more than once and on a dead or stopped peer. An error of
        the child's ``finalize`` is raised once the process is gone.
        """
        process, conn = self._process, self._conn
        if process is None or conn is None:
            return None
        error: Optional[BaseException] = None
        try:
            if not self._dead and process.is_alive():
                if self._stopped:
                    self.cont()
                try:
                    self._call("close", deadline=timeout)
                except PeerError:
                    pass
                except BaseException as exc:
                    error = exc
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout)
        finally:
            exitcode = process.exitcode
            conn.close()
            process.close()
            self._process = self._conn = None
            self._dead = True
        if error is not None:
            raise error
        return exitcode

    def kill(self) -> None:
        """SIGKILLs the child and reaps it; later commands raise ``PeerError``."""
        os.kill(self.pid, signal.SIGKILL)
        self._dead = True
        assert self._process is not None
        self._process.join(10)

    def stop(self) -> None:
        """SIGSTOPs the child and waits until it is stopped; commands are refused until ``cont``."""
        os.kill(self.pid, signal.SIGSTOP)
        self._stopped = True
        deadline = time.monotonic() + 5
        while _process_state(self.pid) != "T":
            assert time.monotonic() < deadline, f"{self!r} did not stop"
            time.sleep(0.005)

    def cont(self) -> None:
        """SIGCONTs a stopped child."""
        os.kill(self.pid, signal.SIGCONT)
        self._stopped = False

    # -- the pipe

    def _call(self, command: str, *args: Any, deadline: Optional[float] = None, **kwargs: Any) -> Any:
        if self._dead or self._conn is None:
            raise PeerError(f"{command}: {self!r} is not running")
        if self._stopped:
            raise PeerError(f"{command}: {self!r} is stopped (SIGSTOP); call cont() first")
        assert command in _COMMANDS, command
        self._conn.send((command, args, kwargs))
        return self._answer(command, self.command_timeout if deadline is None else deadline)

    def _answer(self, command: str, seconds: float) -> Any:
        assert self._process is not None and self._conn is not None
        ready = multiprocessing.connection.wait([self._conn, self._process.sentinel], timeout=seconds)
        if not ready:
            self.kill()
            raise PeerTimeout(f"{command}: no answer from {self!r} within {seconds:g} s; the peer was killed")
        try:
            status, *payload = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            self._dead = True
            raise PeerError(f"{command}: {self!r} exited with code {self._process.exitcode}") from None
        if status == "ok":
            return payload[0]
        exc, text = payload
        exc.add_note(f"raised in {self!r} by command {command!r}:\n{text}")
        raise exc

    # -- commands

    @property
    def listen_port(self) -> Optional[int]:
        """``LLMDataDist.listen_port`` in the child (asked each time)."""
        return self._call("listen_port")

    def allocate(
        self, desc: dd.CacheDesc, blocks: bool = False, keys: Sequence[dd.CacheKey] = (), model_id: Optional[int] = None
    ) -> CacheRef:
        """``allocate_cache`` (or ``allocate_blocks_cache``, bound to ``model_id`` if given) from the host pool."""
        return self._call("allocate", desc, blocks, list(keys), model_id)

    def register(
        self,
        desc: dd.CacheDesc,
        blocks: bool = False,
        keys: Sequence[dd.CacheKey] = (),
        model_id: Optional[int] = None,
        remote_accessible: Optional[bool] = None,
    ) -> CacheRef:
        """``register_cache`` (or ``register_blocks_cache``) of zeroed numpy arrays owned by the child."""
        return self._call("register", desc, blocks, list(keys), model_id, remote_accessible)

    def free(self, ref: CacheRef) -> None:
        """Deallocates or unregisters one cache."""
        self._call("free", ref)

    def free_all(self) -> None:
        """Deallocates or unregisters every cache the commands above created."""
        self._call("free_all")

    def fill(self, ref: CacheRef, seed: int) -> list[np.ndarray]:
        """Writes ``seeded_tensors(ref.desc, seed)`` into the cache and returns those bytes."""
        self._call("fill", ref, seed)
        return seeded_tensors(ref.desc, seed)

    def read(self, ref: CacheRef, tensor: Optional[int] = None) -> Any:
        """A copy of one tensor (flat uint8), or of all of them as a list."""
        return self._call("read", ref, tensor)

    def tensor_addrs(self, ref: CacheRef) -> list[int]:
        """The base address of each tensor of the cache, in the child's memory."""
        return self._call("tensor_addrs", ref)

    def link(self, target: "Peer | int", port: Optional[int] = None, timeout: int = LINK_TIMEOUT_MS) -> Any:
        """``link_clusters`` to a peer (its cluster id and port) or to ``target`` id at ``port``."""
        cluster_id, port, host = _address(target, port)
        return self._call("link", cluster_id, port, timeout, host)

    def unlink(
        self, target: "Peer | int", port: Optional[int] = None, timeout: int = LINK_TIMEOUT_MS, force: bool = False
    ) -> Any:
        """``unlink_clusters``; a dead peer's last port is not needed with ``force``."""
        cluster_id, port, host = _address(target, port, needed=not force)
        return self._call("unlink", cluster_id, port, timeout, force, host)

    def datadist(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls ``LLMDataDist.<method>`` in the child."""
        return self._call("datadist", method, *args, **kwargs)

    def engine(self, method: str, *args: Any) -> Any:
        """Calls a method of the child's native engine (diagnostics such as ``link_stats``)."""
        return self._call("engine", method, *args)

    def set_rlimit(self, name: str, soft: Optional[int]) -> tuple[int, int]:
        """Sets the child's soft limit ``resource.<name>`` (None: up to the hard
        limit); returns the limits now."""
        return self._call("set_rlimit", name, soft)

    def cm(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls ``CacheManager.<method>`` in the child; ``CacheRef`` arguments become its caches."""
        return self._call("cm", method, *args, **kwargs)

    def cm_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Awaits ``CacheManager.<method>_async`` in the child's event loop; returns what ``await`` gave."""
        return self._call("cm_async", method, *args, **kwargs)

    def cm_waited(self, style: str, method: str, *args: Any, **kwargs: Any) -> tuple[Any, str]:
        """``method_async`` waited for in ``style`` (``WAIT_STYLES``): its
        result, and the name of the thread a done-callback ran on ("" for
        the other styles)."""
        return self._call("cm_waited", style, method, *args, **kwargs)

    def run(self, via: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``cm`` when ``via == "sync"``, else ``cm_async``."""
        assert via in ("sync", "async"), via
        return (self.cm if via == "sync" else self.cm_async)(method, *args, **kwargs)

    def gather(
        self, method: str, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]], return_exceptions: bool = False
    ) -> list[Any]:
        """Awaits ``<method>_async(*args, **kwargs)`` for every call at once (``asyncio.gather``)."""
        return self._call("gather", method, [(list(a), dict(k)) for a, k in calls], return_exceptions)

    def stream(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Starts calling ``CacheManager.<method>`` over and over on a thread of the child's."""
        self._call("stream", method, *args, **kwargs)

    def stream_counts(self) -> dict[str, int]:
        """The stream's outcomes so far, by status name."""
        return self._call("stream_counts")

    def stream_stop(self) -> dict[str, int]:
        """Stops the stream; its outcomes by status name."""
        return self._call("stream_stop")

    def renew(self, ref: CacheRef, seed: int) -> tuple[CacheRef, bool]:
        """Frees ``ref`` and at once allocates and fills (``seed``) one like it,
        in one command: the new cache, and whether it lies where ``ref`` did."""
        return self._call("renew", ref, seed)

    def start_task(self, method: str, *args: Any, **kwargs: Any) -> int:
        """Starts ``<method>_async`` and returns a handle for ``task_done`` / ``wait_task``."""
        return self._call("start_task", method, *args, **kwargs)

    def task_done(self, handle: int) -> bool:
        return self._call("task_done", handle)

    def start_task_looked(self, method: str, *args: Any, **kwargs: Any) -> tuple[int, bool]:
        """``start_task``, and whether the task was done as its ``_async`` call
        returned (a look: it reads the task's answers that came)."""
        return tuple(self._call("start_task_looked", method, *args, **kwargs))  # type: ignore[return-value]

    def wait_task(self, handle: int, deadline: Optional[float] = None) -> Any:
        """Awaits a started task in the child's loop; returns its statuses or raises its error."""
        return self._call("wait_task", handle, deadline=deadline)


def _address(target: "Peer | int", port: Optional[int], needed: bool = True) -> tuple[int, Optional[int], str]:
    if isinstance(target, Peer):
        assert target.cluster_id is not None
        if port is None and needed:
            port = target.listen_port
            assert port is not None, f"{target!r} does not listen"
        return target.cluster_id, port, target.address
    return target, port, LOOPBACK


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def wait_until(condition: Callable[[], Any], what: str, seconds: float = 30.0) -> None:
    """Returns once ``condition()`` is true; fails the test, naming `what`,
    after `seconds` (generous: a loaded machine is slow, never wrong)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s"
        time.sleep(0.005)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def unread_socket_bytes(pid: int) -> int:
    """Bytes waiting unread in the receive queues of process `pid`'s TCP and
    Unix sockets (``ss``): a frozen owner's queued request, an answer nobody
    has read yet (a same-host link's connections and answer socket are Unix
    socket pairs)."""
    import subprocess

    inodes = _socket_inodes(pid)
    total = 0
    # Unix: "u_str ESTAB <recv-q> <send-q> <path> <inode> <peer path> <peer inode>".
    unix = subprocess.run(["ss", "-H", "-n", "-a", "-x"], capture_output=True, text=True, check=True, timeout=30)
    for row in unix.stdout.splitlines():
        fields = row.split()
        if len(fields) >= 8 and fields[-3].isdigit() and int(fields[-3]) in inodes:
            total += int(fields[2])
    # TCP: "<state> <recv-q> <send-q> <local> <peer> ... ino:<inode> ...".
    tcp = subprocess.run(["ss", "-H", "-n", "-a", "-t", "-e"], capture_output=True, text=True, check=True, timeout=30)
    for row in tcp.stdout.splitlines():
        fields = row.split()
        inode = next((int(f[4:]) for f in fields if f.startswith("ino:") and f[4:].isdigit()), None)
        if inode in inodes:
            total += int(fields[1])
    return total


def main_thread_sleeps(pid: int, samples: int = 5) -> bool:
    """True when process `pid`'s main thread is asleep (state S) at each of
    `samples` looks 10 ms apart: blocked in a wait, not running toward it."""
    for _ in range(samples):
        if _process_state(pid) != "S":
            return False
        time.sleep(0.01)
    return True


class PeerGroup:
    """Starts peers and closes every one of them on ``close`` / exit, whatever happened."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []

    def start(self, name: str, role: dd.LLMRole, cluster_id: int, **kwargs: Any) -> Peer:
        """``Peer(name).start(role, cluster_id, **kwargs)``, closed with the group."""
        peer = Peer(name)
        self.peers.append(peer)
        return peer.start(role, cluster_id, **kwargs)

    def close(self) -> None:
        errors = []
        for peer in reversed(self.peers):
            try:
                peer.close()
            except BaseException as exc:
                errors.append(exc)
        self.peers.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> "PeerGroup":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
