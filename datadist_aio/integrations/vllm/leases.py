"""The prefill side's requests whose blocks wait for their decode sides.

A prefill request that finished for a remote decode keeps its blocks under
a *lease*: a deadline, and a token the scheduler side drew for it and
announced in the request's ``kv_transfer_params``. Its blocks are freed
once every decode rank that reads it has said *done*, or at the deadline.

A decode rank *claims* a request before its read counts: the claim names
the token, and is granted only while the request still holds its blocks
under that token, which then stay held at least ``hold_s`` longer (the
reader's own timeout). A read of blocks already freed (the lease ran out:
vLLM may have given them to another request) is therefore never taken for
the request's KV: its claim is refused and the decode side reports the load
as failed. The decode side sends the claim beside its reads, not before
them: a claim granted after a read was served still proves the read, since
a request that holds its blocks now held them then (a lease only ever ends).

The worker learns a lease with vLLM's next step after the request
finished, which may come after its decode side's claim (an idle engine
steps again only with new work). Blocks are freed only once this worker
has reported them, so a request it has not heard of yet still holds its
blocks: such a claim is granted, and the lease, when it comes, is held at
least as long as the claim asked (its token checked then). Requests freed
here are remembered (the last ``_MAX_REMEMBERED``), and their claims refused.

Thread rules: ``add`` and ``collect`` are called from vLLM's worker
thread; ``claim`` and ``done`` from the side channel's loop thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

__all__ = ["MAX_READERS", "Leases"]

log = logging.getLogger(__name__)

MAX_READERS = 1024  # decode ranks that may share one prefill rank's request
_MAX_REMEMBERED = 1 << 16
_EARLY_DONE_S = 600.0  # how long a done that came before its lease is kept


class Leases:
    """Leased requests of one prefill worker: deadlines, tokens, readers and claims."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._deadlines: dict[str, float] = {}
        self._tokens: dict[str, str] = {}
        # Decode ranks that said done per request, and how many read it.
        self._dones: OrderedDict[str, list[int]] = OrderedDict()
        # Requests every reader confirmed (kept a while if not leased yet).
        self._released: OrderedDict[str, float] = OrderedDict()
        # Requests whose blocks were freed: a claim on them is refused at once.
        self._gone: OrderedDict[str, None] = OrderedDict()
        # Claims granted before their lease came: request to (hold until, token).
        self._early: OrderedDict[str, tuple[float, str]] = OrderedDict()

    # -- vLLM's worker thread ---------------------------------------------------

    def add(self, leases: Mapping[str, float], tokens: Mapping[str, str]) -> None:
        """Requests whose blocks now wait for a decode side, with their deadlines and tokens."""
        mismatched = []
        with self._lock:
            for req_id, deadline in leases.items():
                token = tokens.get(req_id, "")
                early = self._early.pop(req_id, None)
                if early is not None:
                    deadline = max(deadline, early[0])
                    if early[1] != token:
                        mismatched.append(req_id)
                self._deadlines[req_id] = max(deadline, self._deadlines.get(req_id, 0.0))
                self._tokens[req_id] = token
                self._gone.pop(req_id, None)
        for req_id in mismatched:
            log.warning("datadist_aio connector: request %s was claimed, before its lease came, with another "
                        "token than its own", req_id)

    def collect(self) -> set[str]:
        """Leased requests to free now: every reader said done, or the deadline passed."""
        now = self._clock()
        with self._lock:
            freed = {req_id for req_id in self._deadlines if req_id in self._released}
            for req_id in freed:
                del self._released[req_id]
            while self._released and next(iter(self._released.values())) < now:
                self._released.popitem(last=False)  # confirmations nobody leased
            freed.update(req_id for req_id, deadline in self._deadlines.items() if deadline <= now)
            for req_id in freed:
                del self._deadlines[req_id]
                self._tokens.pop(req_id, None)
                self._dones.pop(req_id, None)
                self._gone[req_id] = None
            while len(self._gone) > _MAX_REMEMBERED:
                self._gone.popitem(last=False)
        return freed

    # -- the loop thread -----------------------------------------------------------

    def done(self, req_ids: list[str], readers: int) -> None:
        """A decode rank is done with these requests; ``readers`` ranks read each."""
        keep_until = self._clock() + _EARLY_DONE_S
        with self._lock:
            for req_id in req_ids[:4096]:
                count = self._dones.setdefault(req_id, [0, readers])
                count[0] += 1
                if count[0] < count[1]:
                    continue
                del self._dones[req_id]
                self._released[req_id] = keep_until
                self._released.move_to_end(req_id)
            while len(self._released) > _MAX_REMEMBERED:
                self._released.popitem(last=False)
            while len(self._dones) > _MAX_REMEMBERED:
                self._dones.popitem(last=False)

    def claim(self, claims: Mapping[str, str], hold_s: float) -> dict[str, list[str]]:
        """Claims requests (id to token): ``{"granted": [...], "refused": [...]}``."""
        granted: list[str] = []
        refused: list[str] = []
        until = self._clock() + hold_s
        with self._lock:
            for req_id, token in claims.items():
                if req_id in self._gone:
                    refused.append(req_id)
                    continue
                deadline = self._deadlines.get(req_id)
                if deadline is None:
                    # Its lease has not come yet: its blocks are still held.
                    held, _ = self._early.get(req_id, (0.0, token))
                    self._early[req_id] = (max(held, until), token)
                    self._early.move_to_end(req_id)
                    granted.append(req_id)
                elif self._tokens.get(req_id, "") != token:
                    refused.append(req_id)
                else:
                    self._deadlines[req_id] = max(deadline, until)
                    granted.append(req_id)
            while len(self._early) > _MAX_REMEMBERED:
                self._early.popitem(last=False)
        return {"granted": granted, "refused": refused}
