"""python -m datadist_aio demo: its errors come at once, with what to change."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.resource_tracker
import subprocess
import sys
import time

import pytest

import datadist_aio
from datadist_aio import demo

pytestmark = pytest.mark.timeout(60)

# The spawned demos start multiprocessing's resource tracker, whose pipe
# would otherwise count as a descriptor the first such test left open.
mp.resource_tracker.ensure_running()


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "datadist_aio", *argv], capture_output=True, text=True, timeout=50)


def test_version():
    done = _run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"datadist_aio {datadist_aio.__version__}"


@pytest.mark.parametrize("argv, words", [
    (["--layers", "0"], "--layers: 0 is below the minimum of 1"),
    (["--blocks", "x"], "--blocks: 'x' is not an integer"),
    (["--block-kib", "-4"], "--block-kib: -4 is below the minimum of 1"),
    (["--transport", "rdma"], "--transport: invalid choice: 'rdma'"),
])
def test_bad_argument_is_named_at_once(argv, words):
    start = time.monotonic()
    done = _run("demo", *argv)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert time.monotonic() - start < 20


def test_a_run_too_big_for_memory_is_refused_before_it_starts(monkeypatch, capsys):
    from datadist_aio.__main__ import main

    monkeypatch.setattr(demo, "available_bytes", lambda: 1 << 30)
    start = time.monotonic()
    assert main(["demo", "--blocks", "4096"]) == 2
    err = capsys.readouterr().err
    assert "needs about 32.3 GiB" in err and "1.0 GiB are available" in err and "fewer --blocks" in err, err
    assert time.monotonic() - start < 30


def test_needed_bytes_counts_both_sides():
    tensor = 256 * 64 * 1024
    assert demo.needed_bytes(32, 256, 64 * 1024) == 2 * (64 * tensor + (16 << 20)) + tensor


def test_the_decode_side_failure_is_reported_at_once():
    """The child's own error comes back through the pipe, not after a 60 s wait."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    decode = ctx.Process(target=demo._decode_main, args=(child, 0, 8, 1024, "secret", "auto"))  # 0 layers: CacheDesc refuses
    decode.start()
    child.close()
    start = time.monotonic()
    try:
        with pytest.raises(demo.DemoError, match="the decode process failed: .*num_tensors"):
            demo._recv(parent, decode, "listen port")
        assert time.monotonic() - start < 30
    finally:
        decode.join(10)
        if decode.is_alive():
            decode.kill()
            decode.join()
        decode.close()  # its sentinel descriptor
        parent.close()


def test_a_decode_side_that_dies_silently_is_reported():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    decode = ctx.Process(target=_exit_at_once)
    decode.start()
    child.close()
    try:
        with pytest.raises(demo.DemoError, match="exited"):
            demo._recv(parent, decode, "listen port")
    finally:
        decode.join(10)
        parent.close()


def _exit_at_once() -> None:
    import os

    os._exit(3)


def test_a_small_run_verifies_every_byte():
    done = _run("demo", "--layers", "2", "--blocks", "16", "--block-kib", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every byte verified" in done.stdout


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_a_small_run_on_a_named_transport_verifies_every_byte(transport):
    if transport == "ucx":
        ok, why = datadist_aio._native.ucx_available()
        if not ok:
            pytest.skip(f"no UCX: {why}")
    done = _run("demo", "--layers", "2", "--blocks", "16", "--block-kib", "4", "--transport", transport)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"({transport.upper()} on loopback, authenticated link)" in done.stdout
    assert "every byte verified" in done.stdout
