"""A decode worker's loads: what one request reads, and when it was done.

A ``Load`` is one request's read from its prefill instance: the engine
tasks of its pulls (one per prefill rank, blocks cache and vLLM KV cache
group), the claims on the prefill's lease still unanswered, and its
outcome. ``start_pulls`` plans and starts the pulls from a route (the same
blocks on both sides move block for block, other layouts as byte ranges,
``layout.plan_ranges``; with pipeline stages, each stage's slice of the
layers into this worker's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import datadist_aio as dd

from .groups import CacheGroup
from .layout import plan_ranges
from .metadata import LoadSpec
from .routes import Route, Source

__all__ = ["Load", "completed_at", "posted_at", "start_pulls"]


@dataclass
class Load:
    """A read in flight; ``tasks`` empty with ``error`` set: it failed before starting."""

    spec: LoadSpec
    start: float
    deadline: float
    tasks: list[dd.CacheTask] = field(default_factory=list)
    nbytes: int = 0
    error: str = ""
    cancelled: bool = False
    local: bool = False  # copied from the inbox, not pulled
    step: int = -1  # the start_loads call that began it; -1: begun later, on the loop thread
    # When get_finished first found it done: the end of its transfer, also
    # while it is held for the rest of its step.
    seen_done: float = 0.0
    # When its reads were posted (0.0: never): after the route to the
    # prefill instance was known, so a first contact is before it.
    posted: float = 0.0
    # Pulls: the route read, and the prefill ranks whose claim on the
    # request's lease has not been answered yet (guarded by the side's lock);
    # stale: a claim was refused (the prefill freed the blocks), which says
    # nothing against the link.
    route: Optional[Route] = None
    holds_pending: int = 0
    stale: bool = False
    # Decode-first: waiting for the prefill's push (or its word to pull);
    # not done, whatever its tasks, until that ends. ``expected``: the
    # prefill ranks told where to push (each pushes its share of the heads),
    # ``landed`` how many said it landed.
    awaiting: bool = False
    expected: tuple[Source, ...] = ()
    landed: int = 0


def completed_at(load: Load) -> float:
    """When the engine completed the load's last operation (``CacheTask.completed_at``,
    on ``time.perf_counter``'s clock); when vLLM's step first found it done
    where the tasks do not say."""
    stamps: list[float] = []
    for task in load.tasks:
        stamp = getattr(task, "completed_at", None)
        if not isinstance(stamp, float):
            return load.seen_done
        stamps.append(stamp)
    if not stamps:
        return load.seen_done
    return max(min(max(stamps), load.seen_done), load.start)


def posted_at(load: Load) -> float:
    """When the load's reads were posted (its start where it never posted any)."""
    return load.posted or load.start


def start_pulls(load: Load, route: Route, manager: dd.CacheManager, caches: list[dd.Cache],
                groups: list[CacheGroup], model_id_base: int) -> None:
    """Starts the reads of one load: per prefill rank, per blocks cache (of
    ``model_id_base`` + its index), the blocks of each vLLM KV cache group the
    cache's tensors serve; its tasks and bytes are added to ``load``."""
    spec, mine = load.spec, route.mine
    kv_groups = spec.kv_groups()
    for group in groups:
        if group.kv_groups[-1] >= len(kv_groups):
            raise ValueError(f"load {spec.req_id} names {len(kv_groups)} KV cache groups; this worker's "
                             f"tensors serve {group.kv_groups[-1] + 1}")
    for source in route.sources:
        theirs = source.layout
        staged = source.head_map.layers
        for index, (cache, group) in enumerate(zip(caches, groups)):
            key = dd.BlocksCacheKey(source.cluster_id, model_id_base + index)
            # Every layer into the same one; with pipeline stages, runs of the
            # stage's layers into this worker's (one read per run).
            spans: list[dict[str, range]] = [{}]
            if staged is not None:
                spans = [{"src_layer_range": range(src, src + count), "dst_layer_range": range(dst, dst + count)}
                         for src, dst, count in staged[index]]
            for span in spans:
                # The tensors read per block: every one, or the runs' layers'.
                tensors = len(span["dst_layer_range"]) * group.per_layer if span else len(group.addresses)
                for kv_group in group.kv_groups:
                    local, remote_all, first_token = kv_groups[kv_group]
                    if not local:
                        continue
                    if source.head_map.whole[index]:
                        # The same blocks on both sides: block for block.
                        skip = first_token // theirs.block_size
                        remote = remote_all[skip:skip + len(local)]
                        if not remote:
                            continue
                        load.tasks.append(manager.pull_blocks_async(
                            key, cache, src_blocks=remote, dst_blocks=local[:len(remote)],
                            tensor_num_per_layer=group.per_layer, **span,
                        ))
                        load.nbytes += group.block_bytes // len(group.addresses) * tensors * len(remote)
                        continue
                    rows = plan_ranges(source.head_map, index, mine, theirs, remote_all, local, first_token)
                    if rows is None:
                        continue
                    load.tasks.append(manager.pull_block_ranges_async(
                        key, cache, rows, tensor_num_per_layer=group.per_layer, **span))
                    load.nbytes += int((rows[:, 4] * rows[:, 5]).sum()) * tensors
