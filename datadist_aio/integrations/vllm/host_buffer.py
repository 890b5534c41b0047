"""Host-buffer mode: device KV blocks staged through registered host memory.

With KV tensors in device memory and ``kv_buffer_device="cpu"``, the
connector allocates one host tensor per KV tensor (same shape and dtype,
pinned where CUDA is present) and registers those instead. vLLM hands the
connector its own block-copy function (``set_host_xfer_buffer_ops``; the
signature of ``vllm.distributed.kv_transfer.kv_connector.utils.copy_kv_blocks``:
source tensors by layer, destination tensors by layer, source block ids,
destination block ids, ``"h2d"`` or ``"d2h"``), which runs the platform's
``swap_out_blocks_to_host`` / ``insert_blocks_to_device``.

- Prefill side: the blocks a step writes for a remote decode are copied
  device to host, layer by layer as ``save_kv_layer`` reports each layer,
  and the rest in ``wait_for_save``, before the step's output (and so the
  decode side's params) leaves the instance.
- Decode side: a load lands in the host buffer; once it has settled the
  request's blocks are copied host to device, before vLLM is told the load
  finished.

A block keeps its id: block ``b`` of the host buffer mirrors block ``b`` of
the device tensor.

With ``kv_buffer_device="cuda"`` (vLLM's default) CUDA tensors are not
staged: the worker registers them in place as device memory
(``kv_placement``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

__all__ = ["CopyBlocks", "HostBuffer", "kv_placement", "needs_host_buffer"]

CopyBlocks = Callable[[dict[str, Any], dict[str, Any], list[int], list[int], str], None]


def _device_index(device: Any) -> int:
    index = getattr(device, "index", None)
    if index is not None:
        return int(index)
    import torch  # pyright: ignore[reportMissingImports]  (vLLM installs it)

    return int(torch.cuda.current_device())


def kv_placement(kv_caches: Mapping[str, Any], kv_buffer_device: Optional[str]) -> tuple[str, Optional[int]]:
    """Where the connector registers vLLM's KV tensors, and the device's index.

    ``("host", None)``: the tensors are host memory, registered in place.
    ``("device", index)``: CUDA tensors of device ``index`` with
    ``kv_buffer_device`` ``"cuda"`` (or unset), registered in place as
    device memory. ``("host_buffer", None)``: device tensors with
    ``kv_buffer_device="cpu"``, staged through a host buffer. ValueError
    for tensors on several devices, on a device other than CUDA without a
    host buffer, or a ``kv_buffer_device`` the connector does not know.
    """
    devices: dict[str, Any] = {}
    for tensor in kv_caches.values():
        device = getattr(tensor, "device", None)
        if device is not None:
            devices.setdefault(str(device), device)
    off_host = sorted(name for name in devices if not name.startswith("cpu"))
    if not off_host:
        return "host", None
    if kv_buffer_device == "cpu":
        return "host_buffer", None
    if kv_buffer_device not in (None, "cuda"):
        raise ValueError(
            f"kv_buffer_device is {kv_buffer_device!r}: this connector takes 'cuda' (register the KV tensors in "
            "place in device memory) or 'cpu' (stage them through a host buffer)"
        )
    if len(devices) > 1:
        raise ValueError(
            f"KV tensors are on {' and '.join(sorted(devices))}: one worker registers the memory of one device "
            "(every KV tensor of a worker must be on the same CUDA device)"
        )
    (name,) = off_host
    device = devices[name]
    if getattr(device, "type", name.split(":")[0]) != "cuda":
        raise ValueError(
            f"KV tensors are on {name}: this connector registers CUDA device memory or host memory; set "
            "kv_buffer_device='cpu' to stage the blocks through a host buffer"
        )
    return "device", _device_index(device)


def needs_host_buffer(kv_caches: Mapping[str, Any], kv_buffer_device: Optional[str]) -> bool:
    """Whether the tensors must be staged; ValueError for a layout the connector cannot register."""
    return kv_placement(kv_caches, kv_buffer_device)[0] == "host_buffer"


class HostBuffer:
    """Host copies of vLLM's KV tensors and the block copies between them.

    ``device`` holds vLLM's tensors by layer name, ``host`` their host
    copies (what gets registered). Called from vLLM's worker thread only.
    """

    def __init__(self, kv_caches: Mapping[str, Any]) -> None:
        import torch  # pyright: ignore[reportMissingImports]  (vLLM installs it)

        pin = bool(torch.cuda.is_available())
        self.device: dict[str, Any] = dict(kv_caches)
        self.host: dict[str, Any] = {}
        by_address: dict[int, Any] = {}
        for name, tensor in kv_caches.items():
            # Layers sharing one tensor share its host copy too.
            host = by_address.get(tensor.data_ptr())
            if host is None:
                host = by_address[tensor.data_ptr()] = torch.empty(
                    tuple(tensor.shape), dtype=tensor.dtype, device="cpu", pin_memory=pin
                )
            self.host[name] = host
        self.copy: Optional[CopyBlocks] = None
        self._saved: set[str] = set()
        self._blocks: list[int] = []

    def _copy(self, src: dict[str, Any], dst: dict[str, Any], blocks: list[int], direction: str) -> None:
        if self.copy is None:
            raise RuntimeError(
                "host-buffer mode needs vLLM's block-copy function, which vLLM passes to "
                "set_host_xfer_buffer_ops; it was not called"
            )
        self.copy(src, dst, blocks, blocks, direction)

    def begin_step(self, blocks: list[int]) -> None:
        """The blocks this step writes for remote decodes (copied out per layer)."""
        self._blocks = list(blocks)
        self._saved = set()

    def save_layer(self, name: str) -> None:
        """Copies one layer's blocks of this step device to host."""
        if self._blocks and name in self.device and name not in self._saved:
            self._saved.add(name)
            self._copy({name: self.device[name]}, {name: self.host[name]}, self._blocks, "d2h")

    def finish_step(self) -> None:
        """Copies the layers ``save_layer`` did not see."""
        if self._blocks:
            rest = [name for name in self.device if name not in self._saved]
            if rest:
                self._copy({n: self.device[n] for n in rest}, {n: self.host[n] for n in rest}, self._blocks, "d2h")
        self._blocks, self._saved = [], set()

    def load(self, blocks: list[int]) -> None:
        """Copies loaded blocks host to device."""
        if blocks:
            self._copy(self.host, self.device, list(blocks), "h2d")
