"""The connector's scheduler side: which requests load, which hold blocks.

It runs in vLLM's scheduler process and never touches KV memory. It speaks
NixlConnector's ``kv_transfer_params`` so the proxies written for NIXL work
unchanged:

- a prefill request carries ``do_remote_decode``; when it finishes (length
  capped) its blocks stay allocated under a lease, and the answer's params
  tell the decode side where they are (``do_remote_prefill``,
  ``remote_block_ids``, ``remote_engine_id``, ``remote_host``,
  ``remote_port``, ``remote_request_id``) and the lease's token
  (``lease_token``), without which the prefill serves no read of them;
- under vLLM's hybrid KV cache manager (several KV cache groups)
  ``remote_block_ids`` holds one list per group, and a sliding-window
  group's list only the blocks its window still needs: the tail;
- a decode request carrying ``do_remote_prefill`` reports its prompt as
  computed externally and asynchronously, and the worker side reads it;
- where the worker side pushes layer by layer or copies to a host buffer
  (``plan_saves``), each step also names the blocks of remote-decode
  requests that the step writes;
- decode-first (``direct.py``): the proxy sends a request to both
  instances with the same ``transfer_id``; the decode's params name the
  prefill (``remote_host``, ``remote_port``, ``tp_size``) and no blocks,
  and its load waits for the prefill to push the prompt into its blocks;
  the prefill's steps name the transfer id with its blocks, and its
  finished request's params go to its worker (``StepPlan.announce``) for a
  decode that must pull instead.

This module imports nothing from vLLM: requests and block lists are used by
the few attributes named here, so it is tested without an engine.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from .direct import valid_transfer_id
from .metadata import LoadSpec, SaveSpec, StepPlan

__all__ = ["ScheduledChunk", "SchedulerSide", "SideSettings", "pair_groups"]

_REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port")


@dataclass(frozen=True)
class SideSettings:
    """Where this instance's prefill blocks are announced, and how long they are held."""

    engine_id: str
    host: str
    port: int
    lease_timeout_s: float = 120.0
    tp_size: int = 1
    # Plan ``StepPlan.saves`` (layer-wise push, host buffer) with this block size.
    plan_saves: bool = False
    block_size: int = 16
    # Per vLLM KV cache group, the trailing blocks a sliding-window group
    # needs (0: every block, full attention); one entry per group.
    window_blocks: tuple[int, ...] = (0,)


class ScheduledChunk(NamedTuple):
    """One request's part of a step, from vLLM's ``SchedulerOutput``.

    ``new_block_ids`` (of the first cache group) extend the request's blocks,
    or replace them when ``replace`` (a new or resumed request); None: no new
    blocks. ``more_new_block_ids``: the same of each further KV cache group
    (vLLM's hybrid KV cache manager), empty with one group.
    """

    req_id: str
    new_block_ids: Optional[list[int]]
    replace: bool
    num_computed_tokens: int
    num_scheduled_tokens: int
    more_new_block_ids: tuple[list[int], ...] = ()


@dataclass
class _Outgoing:
    """A remote-decode request still computing its prompt."""

    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    next_index: int = 0
    transfer_id: str = ""  # decode-first: its decode expects the blocks
    lease_token: str = ""  # decode-first: drawn now, so the worker can name the blocks before the request ends
    more_blocks: list[list[int]] = field(default_factory=list)  # further KV cache groups' blocks


def _params(request: Any) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def _group_blocks(block_ids: Any) -> list[list[int]]:
    """Block ids as one list per KV cache group: a flat list is one group's."""
    block_ids = list(block_ids or ())
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [[int(block) for block in group] for group in block_ids]
    return [[int(block) for block in block_ids]]


def _has_remote(params: dict[str, Any]) -> bool:
    return all(params.get(name) is not None for name in _REMOTE_FIELDS)


def _decode_first(params: dict[str, Any]) -> bool:
    """A decode-first request: the prefill named by ``remote_host`` and
    ``remote_port`` pushes it into this instance's blocks (``direct.py``)."""
    return (valid_transfer_id(params.get("transfer_id")) and params.get("remote_block_ids") is None
            and isinstance(params.get("remote_host"), str) and type(params.get("remote_port")) is int)


def pair_groups(local_groups: list[list[int]], remote_block_ids: Any, windows: Sequence[int],
                first_token: int) -> tuple[list[tuple[list[int], list[int], int]], str]:
    """Each KV cache group's ``(local blocks, remote blocks, first token)``
    for a read, and why the groups cannot pair ("" where they can).

    ``remote_block_ids``: the prefill's, a list or one list per group;
    ``windows``: this instance's trailing blocks per sliding-window group (0:
    full attention); ``first_token``: the first token not found in the local
    prefix cache."""
    remote_groups = _group_blocks(remote_block_ids)
    error = ""
    if any(local_groups) and not len(remote_groups) == len(local_groups) == len(windows):
        error = (f"the prefill sent blocks of {len(remote_groups)} KV cache groups, this instance has "
                 f"{len(local_groups)}: the hybrid KV cache manager must be on for both or for neither")
    groups: list[tuple[list[int], list[int], int]] = []
    for index, (local, remote) in enumerate(zip(local_groups, remote_groups)):
        window = windows[index] if index < len(windows) else 0
        if window and local and remote:
            # A sliding-window group: both lists end at the prompt's last
            # block; the decode reads the tail it allocated, at most the
            # window.
            count = min(len(local), len(remote), window)
            groups.append((local[-count:], remote[-count:], 0))
            continue
        # Local prefix-cache hits cover the leading blocks: the worker reads
        # only the tokens after them (the block sizes may differ, so it maps
        # tokens, not block counts).
        groups.append((local if remote else [], remote if local else [], first_token if local else 0))
    return groups, error


class SchedulerSide:
    """Scheduler-side state of one ``DatadistAioConnector``.

    Called only from vLLM's scheduler thread.
    """

    def __init__(self, settings: SideSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._loads: dict[str, LoadSpec] = {}
        self._leases: dict[str, float] = {}
        self._tokens: dict[str, str] = {}
        # Prefill requests whose blocks are held until the worker side frees them.
        self.held: set[str] = set()
        self._outgoing: dict[str, _Outgoing] = {}
        self._announce: dict[str, dict[str, Any]] = {}
        self._early_tokens: dict[str, str] = {}  # decode-first requests' lease tokens, drawn as they start

    # -- decode side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the prefill instance computed for this request, loaded asynchronously."""
        params = _params(request)
        if not params.get("do_remote_prefill") or not (_has_remote(params) or _decode_first(params)):
            return 0, False
        prompt = getattr(request, "prompt_token_ids", None) or []
        count = len(prompt) - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: Any, local_block_ids: Sequence[Any], num_external_tokens: int) -> None:
        """Plans the read of a request whose blocks were just allocated.

        ``local_block_ids`` are the blocks the external tokens go to (those
        not found in the local prefix cache): a list, or one list per KV
        cache group. Each request is planned once.
        """
        params = _params(request)
        if not params.get("do_remote_prefill"):
            if params.get("do_remote_decode") and self.settings.plan_saves:
                prompt = getattr(request, "prompt_token_ids", None) or []
                transfer_id = params.get("transfer_id")
                if request.request_id not in self._outgoing:
                    named = valid_transfer_id(transfer_id)
                    token = self._early_tokens.setdefault(request.request_id, secrets.token_hex(8)) if named else ""
                    self._outgoing[request.request_id] = _Outgoing(
                        len(prompt), transfer_id=str(transfer_id) if named else "", lease_token=token)
            return
        params["do_remote_prefill"] = False
        if _decode_first(params):
            self._plan_decode_first(request, params, local_block_ids, num_external_tokens)
            return
        if not _has_remote(params):
            return
        local_groups = _group_blocks(local_block_ids) if num_external_tokens > 0 else [[]]
        prompt = getattr(request, "prompt_token_ids", None) or []
        groups, error = pair_groups(local_groups, params["remote_block_ids"], self.settings.window_blocks,
                                    max(0, len(prompt) - num_external_tokens))
        tp_size = params.get("tp_size", 1)
        token = params.get("lease_token", "")
        first, *more = groups or [([], [], 0)]
        self._loads[request.request_id] = LoadSpec(
            req_id=request.request_id,
            local_block_ids=first[0],
            remote_block_ids=first[1],
            remote_engine_id=str(params["remote_engine_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_request_id=str(params.get("remote_request_id", request.request_id)),
            first_token=first[2],
            remote_tp_size=tp_size if type(tp_size) is int and 1 <= tp_size <= 1024 else 1,
            more_groups=more if not error else [],
            lease_token=token if isinstance(token, str) and len(token) <= 64 else "",
            error=error,
        )

    def _plan_decode_first(self, request: Any, params: dict[str, Any], local_block_ids: Sequence[Any],
                           num_external_tokens: int) -> None:
        """A decode-first request: its prefill pushes the tokens after the
        local prefix hits into the blocks just allocated (one KV cache group;
        with several, the prefill names its blocks and this side pulls them,
        paired as ``pair_groups`` pairs them)."""
        prompt = getattr(request, "prompt_token_ids", None) or []
        groups = _group_blocks(local_block_ids) if num_external_tokens > 0 else [[]]
        tp_size = params.get("tp_size", 1)
        engine_id = params.get("remote_engine_id", "")
        self._loads[request.request_id] = LoadSpec(
            req_id=request.request_id,
            local_block_ids=groups[0],
            more_groups=[(group, [], 0) for group in groups[1:]],
            window_blocks=list(self.settings.window_blocks),
            remote_block_ids=[],
            remote_engine_id=engine_id if isinstance(engine_id, str) and len(engine_id) <= 256 else "",
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_request_id="",
            first_token=max(0, len(prompt) - num_external_tokens),
            remote_tp_size=tp_size if type(tp_size) is int and 1 <= tp_size <= 1024 else 1,
            transfer_id=str(params["transfer_id"]),
        )

    # -- prefill side ---------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Sequence[Any]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Keeps a finished prefill's blocks for the decode side; returns
        (blocks freed later, params for the decode request).

        ``block_ids``: a list, or one list per KV cache group (of which a
        sliding-window group's is clipped to the tail its window needs).
        """
        params = _params(request)
        self._outgoing.pop(request.request_id, None)
        if not params.get("do_remote_decode") or getattr(getattr(request, "status", None), "name", "") not in (
                "FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"):
            self._early_tokens.pop(request.request_id, None)
        if params.get("do_remote_prefill"):
            # A decode request that finished (aborted) before its read was
            # planned: only tell the prefill side to free its blocks.
            self.update_state_after_alloc(request, [], 0)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        status = getattr(getattr(request, "status", None), "name", "")
        if status not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"):
            return False, None  # aborted: nothing for a decode side
        groups = _group_blocks(block_ids)
        windows = self.settings.window_blocks
        for index, window in enumerate(windows[:len(groups)]):
            if window:
                groups[index] = groups[index][-window:]
        held = any(groups)
        token = self._early_tokens.pop(request.request_id, "") or secrets.token_hex(8)
        if held:
            self._leases[request.request_id] = self._clock() + self.settings.lease_timeout_s
            self._tokens[request.request_id] = token
            self.held.add(request.request_id)
        answer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups[0] if len(groups) == 1 else groups,
            "lease_token": token,
            "remote_engine_id": self.settings.engine_id,
            "remote_host": self.settings.host,
            "remote_port": self.settings.port,
            "remote_request_id": request.request_id,
            "tp_size": self.settings.tp_size,
        }
        transfer_id = params.get("transfer_id")
        if held and valid_transfer_id(transfer_id):
            # Decode-first: the prefill's worker hands these to the decode
            # where it cannot push (the decode then pulls).
            self._announce[str(transfer_id)] = answer
        return held, answer

    def blocks_freed(self, req_ids: Any) -> None:
        """The worker side freed these prefill requests' blocks."""
        self.held.difference_update(req_ids or ())

    # -- every step -------------------------------------------------------------

    def build_plan(self, scheduled: Any = ()) -> StepPlan:
        """What the worker side does this step (``scheduled``: this step's
        ``ScheduledChunk``s); the state is handed over."""
        plan = StepPlan(loads=self._loads, leases=self._leases, saves=self._saves(scheduled),
                        lease_tokens=self._tokens, announce=self._announce)
        self._loads, self._leases, self._tokens, self._announce = {}, {}, {}, {}
        return plan

    def _all_groups(self, outgoing: _Outgoing) -> Optional[list[list[int]]]:
        """A decode-first request's blocks of every KV cache group as its
        prompt ends, a sliding-window group's clipped to the tail its window
        needs (as ``request_finished`` names them); None with one group."""
        if not outgoing.more_blocks:
            return None
        prompt_blocks = -(-outgoing.prompt_len // self.settings.block_size)
        groups = [outgoing.blocks[:prompt_blocks], *(blocks[:prompt_blocks] for blocks in outgoing.more_blocks)]
        for index, window in enumerate(self.settings.window_blocks[:len(groups)]):
            if window:
                groups[index] = groups[index][-window:]
        return groups

    def _saves(self, scheduled: Any) -> dict[str, SaveSpec]:
        """The blocks each remote-decode request's prompt fills in this step."""
        saves: dict[str, SaveSpec] = {}
        size = self.settings.block_size
        for chunk in scheduled:
            outgoing = self._outgoing.get(chunk.req_id)
            if outgoing is None:
                continue
            if chunk.new_block_ids is not None:
                if chunk.replace:
                    outgoing.blocks = [int(block) for block in chunk.new_block_ids]
                    # A resumed request recomputes from here: its blocks go again.
                    outgoing.next_index = min(outgoing.next_index, chunk.num_computed_tokens // size)
                else:
                    outgoing.blocks.extend(int(block) for block in chunk.new_block_ids)
            for index, new in enumerate(chunk.more_new_block_ids):
                while len(outgoing.more_blocks) <= index:
                    outgoing.more_blocks.append([])
                if chunk.replace:
                    outgoing.more_blocks[index] = [int(block) for block in new]
                else:
                    outgoing.more_blocks[index].extend(int(block) for block in new)
            end = min(chunk.num_computed_tokens + chunk.num_scheduled_tokens, outgoing.prompt_len)
            stop = min(-(-end // size), len(outgoing.blocks))
            last = end >= outgoing.prompt_len
            if stop > outgoing.next_index:
                saves[chunk.req_id] = SaveSpec(
                    req_id=chunk.req_id,
                    block_ids=outgoing.blocks[outgoing.next_index:stop],
                    first_index=outgoing.next_index,
                    total_blocks=-(-outgoing.prompt_len // size),
                    last=last,
                    transfer_id=outgoing.transfer_id,
                    lease_token=outgoing.lease_token,
                    all_groups=self._all_groups(outgoing) if last and outgoing.transfer_id else None,
                    more_block_ids=[blocks[outgoing.next_index:stop] for blocks in outgoing.more_blocks]
                    if outgoing.transfer_id else [],
                )
            outgoing.next_index = end // size
            if last:
                del self._outgoing[chunk.req_id]
        return saves
