"""What a worker's side channel answers: who it is, and the requests peers hold.

A prefill worker (and a decode worker lending an inbox for layer-wise
pushes) listens on a side channel; ``SideChannelAnswers`` turns each frame
into its answer:

- ``hello``: the cluster id, the port the engine listens on, the KV layout;
- ``done``: a decode rank finished reading these requests (``leases.py``);
- ``hold``: a decode rank claims these requests' leases before its reads
  count (``leases.py``, ``claims.py``);
- ``share``, ``claim``, ``commit``, ``abort``: a prefill's use of this
  decode worker's inbox (``inbox.py``);
- decode-first requests (``direct.py``): ``expect`` and ``cancel`` from a
  decode to its prefill, ``landed`` and ``pull`` from the prefill back,
  each answered by the handler its worker gave.

Every field a peer sends is checked; a bad one gets ``{"ok": false, "error":
...}`` and changes nothing. Runs on the connector's loop thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Optional

from .inbox import Inbox
from .layout import WorkerLayout
from .leases import MAX_READERS, Leases

__all__ = ["MAX_IDS", "SideChannelAnswers"]

MAX_IDS = 4096  # requests one frame may name
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _refuse(error: str) -> dict[str, Any]:
    return {"ok": False, "error": error[:512]}


class SideChannelAnswers:
    """The side channel's handler for one worker."""

    def __init__(self, *, engine_id: str, cluster_id: int, listen_port: Callable[[], Optional[int]],
                 layout: WorkerLayout, group_layouts: list[dict[str, Any]], leases: Leases,
                 inbox: Optional[Inbox], handlers: Optional[dict[str, Handler]] = None) -> None:
        self._engine_id = engine_id
        self._cluster_id = cluster_id
        self._listen_port = listen_port
        self._layout = layout
        self._group_layouts = group_layouts
        self._leases = leases
        self._inbox = inbox
        self._handlers = dict(handlers or {})

    async def __call__(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        if op == "hello":
            return {"ok": True, "cluster_id": self._cluster_id, "port": self._listen_port(),
                    "layout": self._layout.to_wire()}
        if op == "done":
            return self._done(message)
        if op == "hold":
            return self._hold(message)
        if op in ("share", "claim", "commit", "abort") and self._inbox is not None:
            return self._answer_inbox(self._inbox, op, message)
        handler = self._handlers.get(op) if isinstance(op, str) else None
        if handler is not None:
            return await handler(message)  # a ValueError it raises is the server's error answer
        return _refuse(f"unknown op {op!r}"[:128])

    def _done(self, message: dict[str, Any]) -> dict[str, Any]:
        req_ids, readers = message.get("req_ids"), message.get("readers", 1)
        if not isinstance(req_ids, list) or not all(isinstance(r, str) and len(r) <= 1024 for r in req_ids):
            return _refuse("req_ids must be a list of strings")
        if type(readers) is not int or not 1 <= readers <= MAX_READERS:
            return _refuse(f"readers must be an int from 1 to {MAX_READERS}")
        # Each decode rank that reads the request says done once.
        self._leases.done(req_ids, readers)
        return {"ok": True}

    def _hold(self, message: dict[str, Any]) -> dict[str, Any]:
        requests, hold_s = message.get("requests"), message.get("hold_s")
        if (not isinstance(requests, dict) or len(requests) > MAX_IDS
                or not all(len(r) <= 1024 and isinstance(t, str) and len(t) <= 64 for r, t in requests.items())):
            return _refuse(f"requests must map at most {MAX_IDS} request ids to lease tokens")
        if not isinstance(hold_s, (int, float)) or not 0 < hold_s <= 3600:
            return _refuse("hold_s must be a number of seconds above 0, at most 3600")
        if message.get("engine_id") != self._engine_id:
            # Another instance's requests (this one restarted at the same
            # address): none of them is held here.
            return {"ok": True, "granted": [], "refused": list(requests)}
        return {"ok": True, **self._leases.claim(requests, float(hold_s))}

    def _answer_inbox(self, inbox: Inbox, op: str, message: dict[str, Any]) -> dict[str, Any]:
        """A prefill side's share, claims, commits and aborts (decode side)."""
        engine_id = message.get("engine_id")
        if not isinstance(engine_id, str) or not 0 < len(engine_id) <= 256:
            return _refuse("engine_id must be a string of 1 to 256 characters")
        if op == "share":
            wanted = message.get("blocks")
            if not isinstance(wanted, int) or wanted <= 0:
                return _refuse("blocks must be a positive integer")
            first, count = inbox.grant(engine_id, wanted)
            return {"ok": True, "cluster_id": self._cluster_id, "port": self._listen_port(),
                    "layout": self._group_layouts, "first": first, "count": count}
        if op == "claim":
            claims, hold_s = message.get("claims"), message.get("hold_s")
            if not isinstance(claims, dict) or len(claims) > MAX_IDS:
                return _refuse(f"claims must be an object of at most {MAX_IDS} requests")
            if not isinstance(hold_s, (int, float)) or not 1 <= hold_s <= 3600:
                return _refuse("hold_s must be a number of seconds from 1 to 3600")
            granted = [
                req_id for req_id, blocks in claims.items()
                if len(req_id) <= 1024 and isinstance(blocks, list) and len(blocks) <= inbox.num_blocks
                and all(type(block) is int for block in blocks) and inbox.claim(engine_id, req_id, blocks, hold_s)
            ]
            return {"ok": True, "granted": granted}
        req_ids = message.get("req_ids")
        if not isinstance(req_ids, list) or len(req_ids) > MAX_IDS or not all(isinstance(r, str) for r in req_ids):
            return _refuse(f"req_ids must be a list of at most {MAX_IDS} strings")
        for req_id in req_ids:
            if op == "commit":
                inbox.commit(engine_id, req_id)
            else:
                inbox.abort(engine_id, req_id)
        return {"ok": True}
