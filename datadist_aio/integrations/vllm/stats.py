"""Transfer records and the plain dict vLLM carries from workers to its loggers.

The dict holds lists of observations (one per request's load) and counters;
``merge`` and ``reduce`` work on it without vLLM, so they are tested alone.

Besides the loads, the counters say who read the answers of the engine's
same-host links since the last report (``LLMDataDist.answer_counts()``):
``answers_read`` all of them, ``answers_read_by_sweep`` those the engine's
housekeeping sweep read because no reader had looked (``AnswerCounter``). A
connector that looks at its tasks each step should leave none to the sweep.

A prefill that pushes layer by layer also counts its steps that saved
(``push_steps``), those whose first layer went to the engine before the
forward saved its last layer (``push_steps_overlapped``: the push overlapped
the forward), those aborted because the forward failed or saved fewer than
all its layers (``push_steps_aborted``), and observes each step's tail
(``push_tail_duration``: seconds from the forward's last save until the push
was committed, or from the abort until the push stopped).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COUNTER_KEYS",
    "LIST_KEYS",
    "AnswerCounter",
    "PushStep",
    "TransferRecord",
    "add_answers",
    "empty",
    "is_empty",
    "merge",
    "record",
    "record_push",
    "reduce",
]

LIST_KEYS = ("transfer_duration", "bytes_transferred", "num_blocks", "seen_duration", "setup_duration",
             "push_tail_duration")
COUNTER_KEYS = ("num_successful_transfers", "num_failed_transfers", "answers_read", "answers_read_by_sweep",
                "push_steps", "push_steps_overlapped", "push_steps_aborted")
SWEEP = "sweep"  # the reader kind of answer_counts() that is the engine's timer sweep


@dataclass(frozen=True)
class TransferRecord:
    """One request's load: seconds from posting its reads until the engine
    completed the last of them (the span NixlConnector's histogram measures,
    from posting a transfer to its completion), bytes moved, blocks, outcome;
    seconds from its start until vLLM's step first found it done
    (``seen_seconds``: the whole load and the wait for that step; a load held
    for the rest of its step does not count the hold); and seconds from its
    start until its reads were posted (``setup_seconds``: a first contact
    with the prefill instance where there was one)."""

    seconds: float
    nbytes: int
    blocks: int
    ok: bool
    seen_seconds: float = 0.0
    setup_seconds: float = 0.0


@dataclass(frozen=True)
class PushStep:
    """One prefill step whose blocks were pushed layer by layer: whether its
    first layer went to the engine before the forward saved its last layer,
    whether it was aborted, and its tail in seconds."""

    overlapped: bool
    aborted: bool
    tail_seconds: float


def empty() -> dict[str, Any]:
    data: dict[str, Any] = {key: [] for key in LIST_KEYS}
    data.update({key: 0 for key in COUNTER_KEYS})
    return data


def record(data: dict[str, Any], item: TransferRecord) -> None:
    """Adds one load: a success is observed in the histograms, a failure only counted."""
    if item.ok:
        data["transfer_duration"].append(item.seconds)
        data["bytes_transferred"].append(item.nbytes)
        data["num_blocks"].append(item.blocks)
        data["seen_duration"].append(item.seen_seconds)
        data["setup_duration"].append(item.setup_seconds)
        data["num_successful_transfers"] += 1
    else:
        data["num_failed_transfers"] += 1


def record_push(data: dict[str, Any], step: PushStep) -> None:
    """Adds one pushed step."""
    data["push_steps"] = data.get("push_steps", 0) + 1
    data["push_steps_overlapped"] = data.get("push_steps_overlapped", 0) + int(step.overlapped)
    data["push_steps_aborted"] = data.get("push_steps_aborted", 0) + int(step.aborted)
    data.setdefault("push_tail_duration", []).append(step.tail_seconds)


def add_answers(data: dict[str, Any], read: int, by_sweep: int) -> None:
    """Adds answers read since the last report (all readers, and the sweep's share)."""
    data["answers_read"] = data.get("answers_read", 0) + read
    data["answers_read_by_sweep"] = data.get("answers_read_by_sweep", 0) + by_sweep


class AnswerCounter:
    """Turns the running totals of ``answer_counts()`` into increases since the last call."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def delta(self, counts: dict[str, int]) -> tuple[int, int]:
        """(answers read by anyone, by the sweep) since the previous ``counts``.

        A reader kind seen for the first time counts from zero; a total that
        went down (a new engine) counts from its new value.
        """
        read = by_sweep = 0
        for name, total in counts.items():
            before = self._last.get(name, 0)
            grown = total - before if total >= before else total
            read += grown
            if name == SWEEP:
                by_sweep = grown
        self._last = dict(counts)
        return read, by_sweep


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    for key in LIST_KEYS:
        into.setdefault(key, []).extend(other.get(key, ()))
    for key in COUNTER_KEYS:
        into[key] = into.get(key, 0) + int(other.get(key, 0))
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(key) for key in COUNTER_KEYS)


def reduce(data: dict[str, Any]) -> dict[str, int | float]:
    """One line's worth for vLLM's periodic log."""
    durations = data.get("transfer_duration", [])
    total_bytes = sum(data.get("bytes_transferred", []))
    total_time = sum(durations)
    return {
        "num_successful_transfers": data.get("num_successful_transfers", 0),
        "num_failed_transfers": data.get("num_failed_transfers", 0),
        "answers_read": data.get("answers_read", 0),
        "answers_read_by_sweep": data.get("answers_read_by_sweep", 0),
        "push_steps": data.get("push_steps", 0),
        "push_steps_overlapped": data.get("push_steps_overlapped", 0),
        "median_xfer_time_ms": round(statistics.median(durations) * 1e3, 3) if durations else 0.0,
        "max_xfer_time_ms": round(max(durations) * 1e3, 3) if durations else 0.0,
        "total_mib": round(total_bytes / 2**20, 3),
        "throughput_mib_s": round(total_bytes / 2**20 / total_time, 1) if total_time > 0 else 0.0,
    }
