"""examples/asyncio_notebook.ipynb, executed in a Jupyter kernel with nbclient.

The notebook awaits the library at the top level of its cells on the kernel's
own event loop, starts a decode process (spawn) and checks the bytes that
arrived there. This test runs every cell (any cell error fails it), then
reads the outputs: the byte counts the decode side verified, the throughput
table, the plot (a PNG) and the decode process's exit code. Whatever happens,
the decode process must be gone afterwards; one that is left is killed and
fails the test.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Optional

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOK = EXAMPLES / "asyncio_notebook.ipynb"

BLOCK_BYTES = 64 * 1024  # the notebook's cache: 16 tensors (8 layers, K and V) of 64 blocks
TENSORS = 16
LAYERWISE_BLOCKS = 24  # the blocks of the layer-wise transfer
PUSH_BLOCKS = 4  # the blocks of the blocking push_blocks
LAST_TRANSFER_BYTES = 64 << 20  # the last (largest) transfer of the throughput cell
SIZES_MIB = [1, 4, 16, 64]


def _stdout(nb: Any) -> str:
    """Everything the code cells printed, in order."""
    return "".join(
        output.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.output_type == "stream" and output.get("name") == "stdout"
    )


def _is_decode_child(pid: int) -> bool:
    """``pid`` is a live (not zombie) process started by multiprocessing's spawn."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            spawned = b"multiprocessing" in cmdline.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return spawned and state not in ("Z", "X")


def _reap_decode_child(pid: Optional[int], wait: float = 10.0) -> bool:
    """Waits up to ``wait`` seconds for the decode process to go; kills it if it
    is still there. True when it had to be killed."""
    if pid is None:
        return False
    deadline = time.monotonic() + wait
    while _is_decode_child(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(240)
def test_asyncio_notebook_runs_and_verifies_its_bytes() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), (
        "the notebook is committed without outputs"
    )
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(EXAMPLES)}}
    )
    decode_pid: Optional[int] = None
    try:
        # async_execute under a loop of its own, closed afterwards (execute()
        # would leave one open for the thread); raises CellExecutionError on
        # the first failing cell.
        asyncio.run(client.async_execute())
    finally:
        # The kernel has shut down by now, with the notebook's last cell run or
        # not; its decode child must follow it (pipe closed, daemon process).
        started = re.search(r"decode process started: pid (\d+)", _stdout(nb))
        decode_pid = int(started.group(1)) if started else None
        left_over = _reap_decode_child(decode_pid)
    assert decode_pid is not None, "the notebook did not report its decode process"
    assert not left_over, f"decode process {decode_pid} outlived the notebook and was killed"

    text = _stdout(nb)
    verified = [int(count) for count in re.findall(r"verified (\d+) bytes", text)]
    assert verified == [
        LAYERWISE_BLOCKS * TENSORS * BLOCK_BYTES,
        PUSH_BLOCKS * TENSORS * BLOCK_BYTES,
        LAST_TRANSFER_BYTES,
    ], text
    assert "no other block touched" in text

    rows = re.findall(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$", text, flags=re.MULTILINE)
    assert [int(mib) for mib, _, _ in rows] == SIZES_MIB, text
    assert all(float(push) > 0 and float(layerwise) > 0 for _, push, layerwise in rows), text

    pngs = [
        base64.b64decode(output["data"]["image/png"])
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.output_type in ("display_data", "execute_result") and "image/png" in output.get("data", {})
    ]
    assert len(pngs) == 1 and pngs[0].startswith(b"\x89PNG\r\n\x1a\n"), "the throughput plot was not rendered"

    assert "decode process exit code: 0" in text, text
