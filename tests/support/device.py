"""Device-memory scenarios on the CUDA driver stand-in (tests/cuda_standin),
each in a spawned process of its own (the driver is loaded once per
process): ``run_pair`` runs an owner and an initiator talking over a Pipe,
``in_child`` one scenario; both sides' engines, caches and checks.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest

from cuda_standin.build import build
from datadist_aio.bench.cuda_driver import CudaDriver

# Spawning starts the resource tracker once per process, with a descriptor
# it keeps: start it before any test counts descriptors.
multiprocessing.resource_tracker.ensure_running()

TIMEOUT_S = 60


OWNER, INITIATOR = 7, 5


MODEL = {"host": 1, "device": 2}  # the owner's blocks caches, by placement


LAYERS, PER_LAYER = 2, 2


TENSORS = LAYERS * PER_LAYER


# Blocks of 96 KiB and slots of 1.5 MiB: operations of several staging
# chunks (1 MiB), whose edges fall inside blocks.
BLOCKS, BLOCK = 24, 96 << 10


SLOTS, SLOT = 2, 3 << 19


MIXES = [("host", "device"), ("device", "host"), ("device", "device")]  # (initiator's, owner's)


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("cuda-standin"))


# -- processes -----------------------------------------------------------------------------------


def run_pair(driver: Path, owner: Callable[..., None], initiator: Callable[..., None], *args: Any,
             killed: Optional[Callable[..., None]] = None, owner_env: Optional[dict[str, str]] = None,
             initiator_env: Optional[dict[str, str]] = None, timeout_s: float = TIMEOUT_S) -> None:
    """Runs ``owner(conn, *args)`` and ``initiator(conn, *args)`` in two spawned
    processes joined by a Pipe (each with the stand-in's environment, updated
    by its own); fails with a child's traceback, or if either dies (but
    ``killed``, which must end by SIGKILL) or outlives ``timeout_s``. Both
    are gone when this returns."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    env = {"DATADIST_AIO_CUDA_DRIVER": str(driver), "STANDIN_CUDA_DEVICES": "1"}
    children = []
    for scenario, end, own in ((owner, mine, owner_env), (initiator, theirs, initiator_env)):
        report, child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child, args=(child, {**env, **(own or {})}, scenario, (end, *args)))
        process.start()
        child.close()
        children.append((scenario.__name__, process, report))
    mine.close()
    theirs.close()
    try:
        # Every child's outcome is gathered before failing: the first to fail
        # is often the one that only saw the other end go away.
        deadline = time.monotonic() + timeout_s
        problems = []
        for name, process, report in reversed(children):
            if not report.poll(max(0.0, deadline - time.monotonic())):
                problems.append(f"{name} did not finish within {timeout_s} s")
                continue
            try:
                outcome = report.recv()
            except EOFError:
                process.join(10)
                if killed is not None and name == killed.__name__ and process.exitcode == -signal.SIGKILL:
                    continue
                problems.append(f"{name}: the process died (exit code {process.exitcode})")
                continue
            if killed is not None and name == killed.__name__:
                problems.append(f"{name} was to be killed, but ended with: {outcome}")
            elif outcome != "ok":
                problems.append(f"{name} failed in its process:\n{outcome}")
        if problems:
            pytest.fail("\n".join(problems))
    finally:
        for _, process, report in children:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
            process.close()
            report.close()


CHILD_TIMEOUT_S = 90  # in_child's scenario


def in_child(scenario: Callable[..., None], driver: Optional[Path], devices: int = 1, *args: Any) -> None:
    """Runs ``scenario(*args)`` in a spawned process whose engine loads
    ``driver`` (a path that may not exist) with ``devices`` devices; fails
    with the child's traceback, or if it dies or outlives CHILD_TIMEOUT_S."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    env = {"DATADIST_AIO_CUDA_DRIVER": str(driver) if driver else "", "STANDIN_CUDA_DEVICES": str(devices)}
    process = ctx.Process(target=_child, args=(child, env, scenario, args))
    process.start()
    child.close()
    try:
        if not parent.poll(CHILD_TIMEOUT_S):
            pytest.fail(f"{scenario.__name__} did not finish within {CHILD_TIMEOUT_S} s")
        try:
            outcome = parent.recv()
        except EOFError:
            process.join(10)
            pytest.fail(f"{scenario.__name__}: the process died (exit code {process.exitcode})")
        if outcome != "ok":
            pytest.fail(f"{scenario.__name__} failed in its process:\n{outcome}")
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)
        process.close()
        parent.close()


def _child(report: Any, env: dict[str, str], scenario: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(env)
    try:
        scenario(*args)
        report.send("ok")
    except BaseException:  # noqa: BLE001 - reported to the test
        report.send(traceback.format_exc())
    finally:
        report.close()


def _recv(conn: Any) -> Any:
    assert conn.poll(TIMEOUT_S), "the other process said nothing in time"
    return conn.recv()


# -- both sides ----------------------------------------------------------------------------------


def _engine(role: Any, cluster_id: int, transport: str, listen: bool, rca: bool = True, pool_bytes: int = 64 << 20,
            timeout_ms: int = 10000, access: Optional[str] = "owner") -> Any:
    """An engine; ``access`` "owner" unless asked (these suites test what an
    owner serves; test_device_transfer.py runs one-sided access too), None
    leaving it unset."""
    import datadist_aio as dd
    from support.peer import pool_cfg

    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = rca
    config.host_mem_pool_cfg = pool_cfg(pool_bytes)
    config.transport = transport
    config.sync_kv_timeout = timeout_ms
    if access is not None:
        config.access = access
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    datadist = dd.LLMDataDist(role, cluster_id)
    datadist.init(config.generate_options())
    return datadist


def wait_for_grants(datadist: Any, count: int) -> None:
    """Until this end holds ``count`` grants of OWNER's caches (one-sided access)."""
    deadline = time.monotonic() + TIMEOUT_S
    while datadist._engine.link_stats(OWNER)["grants_held"] < count:
        assert time.monotonic() < deadline, datadist._engine.link_stats(OWNER)
        time.sleep(0.01)


def frames_sent(datadist: Any) -> bool:
    """Whether the initiator has sent a device frame to OWNER, over CUDA IPC or staged."""
    stats = datadist._engine.link_stats(OWNER)
    return stats["ipc_frames"] + stats["staged_frames"] > 0


def _desc(placement: str, blocks: bool) -> Any:
    import datadist_aio as dd

    where = dd.Placement.DEVICE if placement == "device" else dd.Placement.HOST
    shape = [BLOCKS, BLOCK] if blocks else [SLOTS, SLOT]
    return dd.CacheDesc(TENSORS, shape, dd.DataType.DT_UINT8, where)


def _pattern(seed: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(TENSORS)]


class Caches:
    """One side's caches: a blocks cache and a slots cache per placement."""

    def __init__(self, cm: Any, cuda: Any, bind_blocks: bool) -> None:
        import datadist_aio as dd

        self.cm, self.cuda = cm, cuda
        self.caches: dict[str, Any] = {}
        for placement in ("host", "device"):
            key = dd.BlocksCacheKey(OWNER, MODEL[placement]) if bind_blocks else None
            self.caches[f"blocks-{placement}"] = cm.allocate_blocks_cache(_desc(placement, True), key)
            self.caches[f"slots-{placement}"] = cm.allocate_cache(_desc(placement, False))

    def fill(self, name: str, seed: int) -> list[np.ndarray]:
        cache = self.caches[name]
        data = _pattern(seed, cache.cache_desc.size)
        for t, addr in enumerate(cache.tensor_addrs):
            if name.endswith("device"):
                self.cuda.write(addr, data[t])
            else:
                cache.as_numpy(t).reshape(-1)[:] = data[t]
        return data

    def read(self, name: str) -> list[np.ndarray]:
        cache = self.caches[name]
        if name.endswith("device"):
            return [self.cuda.read(addr, cache.cache_desc.size) for addr in cache.tensor_addrs]
        return [cache.as_numpy(t).reshape(-1).copy() for t in range(TENSORS)]

    def free(self) -> None:
        for name, cache in self.caches.items():
            if name.startswith("blocks"):
                self.cm.deallocate_blocks_cache(cache)
            else:
                self.cm.deallocate_cache(cache)


def owner_serves(conn: Any, transport: str, access: str = "owner") -> None:
    """Holds caches in host and device memory; fills, reads and renews them
    when asked, and tells its link's stats and its pid."""
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=True, access=access)
    caches = Caches(datadist.cache_manager, cuda, bind_blocks=True)
    conn.send((
        datadist.listen_port,
        {name: cache.cache_id for name, cache in caches.caches.items()},
        {name: cache.tensor_addrs for name, cache in caches.caches.items()},
    ))
    while True:
        command, *args = _recv(conn)
        if command == "fill":
            caches.fill(*args)
            conn.send("filled")
        elif command == "read":
            conn.send(caches.read(*args))
        elif command == "transport":
            conn.send(datadist.link_transport(INITIATOR))
        elif command == "stats":
            conn.send(datadist._engine.link_stats(INITIATOR))
        elif command == "pid":
            conn.send(os.getpid())
        elif command == "renew":
            # The device slots cache freed (when: the monotonic clock is the
            # host's), and a moment later one like it made and filled.
            (seed,) = args
            cm = datadist.cache_manager
            cm.deallocate_cache(caches.caches["slots-device"])
            freed = time.monotonic()
            time.sleep(0.05)
            caches.caches["slots-device"] = cm.allocate_cache(_desc("device", False))
            caches.fill("slots-device", seed)
            conn.send((caches.caches["slots-device"].cache_id, freed))
        else:
            break
    caches.free()
    datadist.finalize()


class Remote:
    """The owner, as the initiator drives it; keeps what its caches should hold."""

    def __init__(self, conn: Any, ids: dict[str, int]) -> None:
        self.conn, self.ids = conn, ids
        self.expect: dict[str, list[np.ndarray]] = {}

    def fill(self, name: str, seed: int) -> None:
        self.conn.send(("fill", name, seed))
        assert _recv(self.conn) == "filled"
        self.expect[name] = _pattern(seed, BLOCKS * BLOCK if name.startswith("blocks") else SLOTS * SLOT)

    def check(self, name: str, what: str) -> None:
        self.conn.send(("read", name))
        got = _recv(self.conn)
        for t in range(TENSORS):
            np.testing.assert_array_equal(got[t], self.expect[name][t], err_msg=f"{what}: the owner's tensor {t}")


def _check_local(got: list[np.ndarray], expect: list[np.ndarray], what: str) -> None:
    for t in range(TENSORS):
        np.testing.assert_array_equal(got[t], expect[t], err_msg=f"{what}: tensor {t}")


def _blocks(data: np.ndarray) -> np.ndarray:
    return data.reshape(BLOCKS, BLOCK)


def _slots(data: np.ndarray) -> np.ndarray:
    return data.reshape(SLOTS, SLOT)
