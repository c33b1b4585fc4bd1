"""The model runner's batch order: which row of the flattened batch each request takes.

Upstream counterparts (v0.32.0):
- `vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states` (drop the requests not
  scheduled this step, add the new ones, then the returning ones, then condense)
- `vllm.v1.worker.gpu_input_batch.InputBatch.add_request / remove_request / condense`

Upstream keeps each request's state (token ids, block table row, sampling parameters) in a row
of buffers that persist across steps, so a step only rewrites the rows that changed. The batch
order is therefore not the scheduler's queue order: a request that finishes leaves a hole, a new
request takes the lowest hole, and `condense` moves the last rows down into the holes left over.
E.g. rows [a, b, c, d], b finishes: d moves into row 1 and the batch is [a, d, c].
The order matters to anyone reading the runner's buffers (input ids, positions, slot mapping,
logits indices, attention outputs) row by row, so the reimpl lays its batch out the same way.
Only the order is kept here; the rows' contents are built fresh each step (engine.prepare_inputs).
"""

from __future__ import annotations


class InputBatch:
    def __init__(self):
        self.rows: list[str] = []  # req_id per row, in batch order

    def update(self, scheduled: list) -> list[str]:
        """Rows for this step's scheduled requests (`Scheduled`s, in the scheduler's output order)."""
        ids = {s.req_id for s in scheduled}
        rows: list[str | None] = [rid if rid in ids else None for rid in self.rows]  # finished, preempted, idle
        holes = [i for i, rid in enumerate(rows) if rid is None]
        present = set(rows)
        # upstream adds scheduled_new_reqs first, then the cached requests missing from the batch
        # (resumed after preemption, or running but not scheduled last step), each into the lowest hole
        adds = [s.req_id for s in scheduled if s.kind == "new"]
        adds += [s.req_id for s in scheduled if s.kind != "new" and s.req_id not in present]
        for rid in adds:
            if holes:
                rows[holes.pop(0)] = rid
            else:
                rows.append(rid)
        for hole in holes:  # condense: the last request moves into the lowest hole
            while rows and rows[-1] is None:
                rows.pop()
            if hole >= len(rows):
                break
            rows[hole] = rows.pop()
        self.rows = [rid for rid in rows if rid is not None]  # what is left of the holes is past the end
        return self.rows
