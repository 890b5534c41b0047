"""Plain records the scheduler side hands to the worker side each step.

They cross vLLM's own scheduler-to-worker channel, never the network, and
hold only ints, strings, lists and plain dicts of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["LoadSpec", "SaveSpec", "StepPlan"]


@dataclass
class LoadSpec:
    """One request whose prompt KV the decode side reads from a prefill instance.

    ``remote_block_ids`` hold the whole prompt on the prefill;
    ``local_block_ids`` receive it from token ``first_token`` on (the tokens
    before were found in the local prefix cache). The two instances' block
    sizes may differ. An empty ``local_block_ids`` means nothing to read, only
    the prefill to release. ``remote_port`` is the side channel of the
    prefill's rank 0; rank ``r`` of its ``remote_tp_size`` listens on
    ``remote_port + r`` (with pipeline stages, stage ``s``'s rank ``r`` on
    ``remote_port + s * remote_tp_size + r``; the hello says how many).

    Those three fields are vLLM's first KV cache group; ``more_groups``
    holds ``(local_block_ids, remote_block_ids, first_token)`` of each
    further one (the hybrid KV cache manager: a sliding-window group's
    lists are the in-window tails, aligned by the scheduler side, with a
    first token of 0). ``lease_token`` is the prefill's token for this
    request's blocks: a read counts only while the request holds them under
    that token.
    """

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    # The prefill's own request id, used to release its blocks.
    remote_request_id: str
    first_token: int = 0
    remote_tp_size: int = 1
    more_groups: list[tuple[list[int], list[int], int]] = field(default_factory=list)
    lease_token: str = ""
    # Decode-first (``direct.py``): the prefill pushes the prompt into
    # ``local_block_ids`` itself; ``remote_block_ids`` stay empty until the
    # prefill says to pull instead.
    transfer_id: str = ""
    # Decode-first: this instance's trailing blocks per sliding-window group
    # (0: full attention), for pairing the prefill's blocks if it says pull.
    window_blocks: list[int] = field(default_factory=list)
    # Set where the load cannot be planned (the layouts of KV cache groups
    # differ): the worker side fails it at once, its blocks reported.
    error: str = ""

    def kv_groups(self) -> list[tuple[list[int], list[int], int]]:
        """``(local_block_ids, remote_block_ids, first_token)`` of every KV cache group, in order."""
        return [(self.local_block_ids, self.remote_block_ids, self.first_token), *self.more_groups]

    def all_local_blocks(self) -> list[int]:
        """Every block this load writes, of every KV cache group."""
        return [block for local, _remote, _first in self.kv_groups() for block in local]


@dataclass
class SaveSpec:
    """Blocks of a request bound for a remote decode that this step writes.

    ``block_ids[k]`` holds the request's block ``first_index + k``; the
    request has ``total_blocks`` prompt blocks in all, and ``last`` says this
    step computes the end of its prompt. A block the step only partly fills
    is listed again in the next step.
    """

    req_id: str
    block_ids: list[int]
    first_index: int
    total_blocks: int
    last: bool
    # Decode-first: the request's transfer id (its decode names it in
    # ``expect``), and the token its lease will have (for a decode that pulls).
    transfer_id: str = ""
    lease_token: str = ""
    # Decode-first, in the step that ends the prompt, with several KV cache
    # groups: every group's blocks (a sliding-window group's in-window
    # tail), for a decode that pulls them.
    all_groups: Optional[list[list[int]]] = None
    # With several KV cache groups: each further group's blocks of the step,
    # of the same prompt block indices as ``block_ids``.
    more_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class StepPlan:
    """What the worker side does in one scheduler step.

    ``loads``: reads to start. ``leases``: prefill requests whose blocks now
    wait for a decode side, with the monotonic deadline after which they are
    freed anyway, and ``lease_tokens`` the token each was announced with
    (its decode side names it to read). ``saves``: blocks of requests bound for a remote decode
    written in this step (planned only where they are pushed layer by layer
    or copied to a host buffer).
    """

    loads: dict[str, LoadSpec] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)
    saves: dict[str, SaveSpec] = field(default_factory=dict)
    lease_tokens: dict[str, str] = field(default_factory=dict)
    # Decode-first requests that finished on this prefill: their
    # ``kv_transfer_params`` by transfer id, for a decode that must pull.
    announce: dict[str, dict[str, Any]] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not self.loads and not self.leases and not self.saves and not self.announce
