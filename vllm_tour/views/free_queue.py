"""The KV pool's free queue, rebuilt from a run's records under its release's free-queue policy.

Upstream keeps free blocks in one queue (FreeKVCacheBlockQueue, block ids in order at start; block 0 is the null
block). BlockPool.get_new_blocks takes new blocks from its head (pool-get-new); a prefix hit takes its blocks out
wherever they sit (pool-touch); a freed request's blocks go back tail first (kvm-free-reverse), and where they go
is what differs between releases -- the pin profile's `free_queue_policy`:
- "append_all" (v0.21.0): every freed block to the back;
- "uncached_to_front" (v0.31.0, v0.32.0): blocks without a hash to the front (reused first), cached ones to the back
  (pool-free-order).
The records hold what each step allocated, freed and hit, not the queue. Rebuilding it and checking every recorded
allocation against its head is how `explain` can say that an allocation followed the policy -- or that the
records do not fit it (from then on the rebuild has lost track and says nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_tour.trace.reader import Run

POLICIES = ("append_all", "uncached_to_front")


@dataclass
class Allocation:
    step: int
    req_id: str
    blocks: list[int]  # as recorded (kv.allocated)
    expected: list[int] | None  # the head of the rebuilt queue; None: the rebuild had lost track before this


def rebuild(run: Run, policy: str, hashed: Callable[[int, int], bool]) -> dict[tuple[int, str], Allocation]:
    """Every recorded allocation, by (step, request), beside what the rebuilt queue's head held.

    `hashed(block, step)`: whether the block held a cached prefix when it was freed at `step` (only
    "uncached_to_front" asks)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown free-queue policy {policy!r} (known: {', '.join(POLICIES)})")
    out: dict[tuple[int, str], Allocation] = {}
    first = next((s.kv for s in run.steps if s.kv), None)
    if first is None:
        return out
    queue: list[int] | None = list(range(1, first.num_blocks + 1))  # None once an allocation does not fit it
    tables: dict[str, list[int]] = {}  # the previous KV record's block tables

    def free(blocks: list[int], step: int) -> None:
        front, back = [], []
        for b in reversed(blocks):  # tail first (kvm-free-reverse)
            (back if policy == "append_all" or hashed(b, step) else front).append(b)
        queue[:0] = front
        queue.extend(back)

    for s in run.steps:
        kv, sch = s.kv, s.scheduler
        if kv is None or sch is None:
            continue
        by_victim = {p.req_id: list(p.freed_block_ids) for p in sch.preempted}
        victim_blocks = {b for ids in by_victim.values() for b in ids}
        if queue is not None:
            # Requests that finished (or were aborted) since the last step: kv.freed lists each one's blocks in
            # table order, one request after another.
            for blocks in _by_owner([b for b in kv.freed if b not in victim_blocks], tables):
                free(blocks, s.index)
        for rid, got in kv.allocated.items():  # in the order the pool handed them out
            for p in sch.preempted:  # a victim's blocks go back before the allocation retried for the request
                if p.while_allocating_for == rid and p.req_id != rid and queue is not None:
                    free(by_victim.pop(p.req_id, []), s.index)
            if queue is not None:  # its prefix hits leave the queue just before (pool-touch)
                hits = {b for h in kv.prefix_hits if h.req_id == rid for b in h.block_ids}
                queue = [b for b in queue if b not in hits]
            if not got:
                continue
            expected = queue[: len(got)] if queue is not None else None
            out[(s.index, rid)] = Allocation(s.index, rid, list(got), expected)
            if queue is not None:
                queue = queue[len(got):] if expected == got else None
        if queue is not None:
            for ids in by_victim.values():  # a request that preempted itself: nothing was allocated after it
                free(ids, s.index)
        tables = kv.block_tables
    return out


def _by_owner(freed: list[int], tables: dict[str, list[int]]) -> list[list[int]]:
    """Split a step's freed blocks into one list per request, by the table each block was in before."""
    owner = {b: rid for rid, ids in tables.items() for b in ids}
    runs: list[list[int]] = []
    last = None
    for b in freed:
        if not runs or owner.get(b) != last:
            runs.append([])
            last = owner.get(b)
        runs[-1].append(b)
    return runs
