"""The runner and attention records, built from what the worker's hooks copied out (runner.py, attention.py).

A worker hook only reads: a header (ids, counts, flags) and the arrays the step left in the runner's and the
attention metadata's buffers. Turning them into records (lists, the block-table diff, the slot mapping from
host state) is done by `WorkerRecords.handle`, on the same header and arrays, in one of two places: the spool's
helper process (trace/spool.py: the arrays cross over as raw bytes, and none of this runs on the engine's
thread), or right away in the hook's process when there is no helper.

Messages (header list; arrays):
  prepare   [kind, proc, step, req_ids, mode, decode, logits_given]; num_scheduled_tokens, input_ids,
            query_start_loc, then mode "tensors": positions, seq_lens, logits_indices (the runner's own
            tensors), or mode "host" (v0.21.0 on CUDA, see runner._host_exact): num_computed_tokens,
            seq_lens, [query_pos unless decode], [logits_indices if logits_given]
  attention [kind, proc, step, static (the record's fixed fields, then the probe's name and target),
            num_reqs, num_tokens, block_size, batch, zero_rows, row length, columns sent];
            query_start_loc, seq_lens, block-table rows (flattened, their first columns: the others 0),
            [slot_mapping unless block_size]
            (block_size > 0: the slot mapping follows from the prepare message's host state, as
            block_table._compute_slot_mapping_kernel computes it on the GPU)
  finish    [kind, proc, step, num_tokens, sampled req ids or None, sampled token ids or None]
"""

from __future__ import annotations

import operator
from bisect import bisect_left

import numpy as np

from ..trace.schema import int_digest
from ..trace.req_ids import user_req_id

RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"  # the CPU runner inherits its methods
# The probes whose messages these are, for the probe-error record of a message that fails here (an attention
# message names its probe in its header: one per backend).
PROBES = {"prepare": ("runner.prepare_inputs", f"{RUNNER}._prepare_inputs"), "finish": ("runner.sample_tokens", f"{RUNNER}.sample_tokens")}
FULL_LIMIT = 256  # lists longer than this are summarized
EDGE = 16
FEW_ROWS = 32  # a decode step's changed rows: up to this many, row by row costs less than numpy's calls over them


def int_list(values) -> dict:
    """A schema.IntList as a dict, from a 1-D integer numpy array: in full up to FULL_LIMIT
    values, else summarized (head, tail, digest of the buffer)."""
    n = len(values)
    if n <= FULL_LIMIT:
        return {"full": values.tolist(), "length": n, "head": [], "tail": [], "sha256": None}
    return {"full": None, "length": n, "head": values[:EDGE].tolist(), "tail": values[-EDGE:].tolist(), "sha256": int_digest(values)}


_EMPTY = {"full": [], "length": 0, "head": [], "tail": [], "sha256": None}  # a schema.IntList; encoded, never mutated


def trim_rows(table: np.ndarray, rows: list[int] | None = None) -> list[list[int]]:
    """Block-table rows (the listed ones, ascending, else all) without their trailing zeros.

    Rows are padded with 0, upstream's null block, which no request owns.
    """
    if rows is None:
        rows = range(len(table))
    if len(rows) <= FEW_ROWS or table.size == 0:  # row by row: no fancy indexing or per-call numpy costs
        # A row's bytes without their trailing zero bytes end inside its last non-zero block (little or big
        # endian alike: that block has a non-zero byte, all later blocks are zero): converted up to there only.
        size = table.itemsize
        return [row[: -(-len(row.tobytes().rstrip(b"\0")) // size)].tolist() for row in map(table.__getitem__, rows)]
    if len(rows) < len(table):
        table = table[rows]
    nonzero = table != 0
    widths = np.where(np.logical_or.reduce(nonzero, axis=1), table.shape[1] - nonzero[:, ::-1].argmax(axis=1), 0)
    trimmed = table[:, : int(np.maximum.reduce(widths))].tolist()  # convert only the used columns
    return list(map(operator.getitem, trimmed, map(slice, widths.tolist())))  # row[:w], without a Python loop


class WorkerRecords:
    """One worker process's runner and attention records, message by message (see the module's docstring)."""

    def __init__(self) -> None:
        self.runner: dict | None = None  # the runner record of the step under way, from its prepare message
        self.host = None  # (request index per token, positions) of that step, mode "host"
        self.prev_table = None  # (step, copy of the block-table rows the previous attention record saw, their count)
        self.slots = None  # the last attention record's slot mapping, an array (captures read it)

    def handle(self, header: list, arrays: list) -> list[dict]:
        """The records this message completes (the attention record; the runner record at `finish`)."""
        kind = header[0]
        if kind == "prepare":
            self._prepare(header, arrays)
            return []
        if kind == "attention":
            return [self._attention(header, arrays)]
        return [self._finish(header)]

    def _prepare(self, header: list, arrays: list) -> None:
        _, proc, step, req_ids, mode, decode, logits_given = header
        num_scheduled, input_ids, qsl, *rest = arrays
        self.host = None
        if mode == "tensors":
            positions, seq_lens, logits = rest
        else:
            computed, seq_lens, *rest = rest
            num_reqs = len(computed)
            if decode:  # one token per request: token i is request i's, at its computed length
                req_indices = np.arange(num_reqs)
                positions = computed.astype(np.int64)
            else:
                query_pos, *rest = rest
                req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
                positions = computed[req_indices].astype(np.int64) + query_pos
            # no speculative decoding: upstream's query_start_loc[1:] - 1
            logits = rest[0] if logits_given else qsl[1:] - 1
            self.host = (req_indices, positions)
        self.runner = {
            "step": step,
            "req_ids": req_ids,
            "num_scheduled_tokens": num_scheduled.tolist(),
            "input_ids": int_list(input_ids),
            "positions": int_list(positions),
            "query_start_loc": qsl.tolist(),
            "seq_lens": seq_lens.tolist(),
            "logits_indices": logits.tolist(),
        }

    def _attention(self, header: list, arrays: list) -> dict:
        _, proc, step, static, num_reqs, n, block_size, batch, zero_rows, cols, width = header
        qsl, seq_lens, table, *slots = arrays
        table = table.reshape(-1, width)
        if width < cols:  # the columns not sent are 0
            table = np.concatenate([table, np.zeros((len(table), cols - width), table.dtype)], axis=1)
        if block_size:
            slots = self._host_slots(table, block_size, n)
            table = table[:batch]
        else:
            slots = slots[0]
        if self.runner is not None and self.runner["step"] == step:
            self.runner["slot_mapping"] = int_list(slots)
        self.slots = slots
        backend, layout, isa, layers, num_layers, num_kv_heads, head_size = static[:7]
        return {  # a schema.AttentionRecord, as a dict
            "step": step,
            "proc": proc,
            "kind": "attention",
            "backend": backend,
            "layout": layout,
            "isa": isa,
            "num_reqs": num_reqs,
            "seq_lens": seq_lens.tolist(),
            "query_lens": (qsl[1:] - qsl[:-1]).tolist(),
            **self._block_rows(step, table, zero_rows),
            "layers": layers,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_size": head_size,
        }

    def _host_slots(self, rows: np.ndarray, size: int, n: int) -> np.ndarray:
        """Block id * block size + offset for each scheduled token, PAD_SLOT_ID -1 for the tokens past them."""
        req_indices, positions = self.host
        index, offset = np.divmod(positions, size)
        slots = rows[req_indices, index].astype(np.int64)
        slots *= size
        slots += offset
        if n > len(slots):  # tokens past the scheduled ones (padding): PAD_SLOT_ID
            slots = np.concatenate([slots, np.full(n - len(slots), -1, np.int64)])
        return slots

    def _block_rows(self, step: int, table: np.ndarray, zero_rows: int = 0) -> dict:
        """The block-table fields of this step's attention record: the rows that differ
        from the previous record's (see schema.AttentionRecord.block_table_since).

        `table` holds the batch's rows; `zero_rows` more rows of 0 follow it (a CUDA graph's
        padding rows, zero on the GPU and stale on the host: never copied to be zeroed).
        In decode steps a few rows change per step (a request crossing a block boundary,
        a finished request's row refilled). The comparison base is a copy of the previous
        record's rows, kept across steps and updated in place on the changed rows.
        """
        real, cols = table.shape
        num_rows = real + zero_rows
        prev = self.prev_table
        if prev is None or prev[1].shape[1] != cols:
            base = np.zeros((num_rows, cols), table.dtype)
            base[:real] = table
            self.prev_table = (step, base, num_rows)
            return {"block_table": trim_rows(table) + [[] for _ in range(zero_rows)], "block_table_since": None,
                    "block_table_rows": None}
        since, base, seen = prev
        n = min(seen, real)
        # ufunc and method calls, not np.any / np.flatnonzero: their Python wrappers cost more than the work here
        rows = np.logical_or.reduce(table[:n] != base[:n], axis=1).nonzero()[0].tolist()
        if zero_rows and real < seen:  # padding now where the previous record had rows: changed unless those were 0
            rows += (np.logical_or.reduce(base[real : min(seen, num_rows)] != 0, axis=1).nonzero()[0] + real).tolist()
        rows.extend(range(seen, num_rows))  # rows the previous record did not have
        if len(base) < num_rows:
            base = np.concatenate([base, np.zeros((num_rows - len(base), cols), base.dtype)])
        cut = bisect_left(rows, real)  # rows[:cut] are the batch's, the rest padding
        if cut:
            base[rows[:cut]] = table[rows[:cut]]
        if cut < len(rows):
            base[rows[cut:]] = 0
        self.prev_table = (step, base, num_rows)
        trimmed = trim_rows(table, rows[:cut]) + [[] for _ in range(len(rows) - cut)]
        return {"block_table": trimmed, "block_table_since": since, "block_table_rows": rows}

    def _finish(self, header: list) -> dict:
        _, proc, step, num_tokens, ids, tokens = header
        p, self.runner = (self.runner or {}), None
        if p.get("step") != step:
            p = {}
        sampled: dict[str, list[int]] = dict(zip(map(user_req_id, ids), tokens)) if ids else {}
        req_ids = p.get("req_ids", [])
        user_ids = list(sampled) if ids == req_ids and len(sampled) == len(req_ids) else list(map(user_req_id, req_ids))
        return {  # a schema.RunnerRecord, as a dict
            "step": step,
            "proc": proc,
            "kind": "runner",
            "num_tokens": num_tokens,
            "req_ids": user_ids,
            "num_scheduled_tokens": p.get("num_scheduled_tokens", []),
            "input_ids": p.get("input_ids") or _EMPTY,
            "positions": p.get("positions") or _EMPTY,
            "query_start_loc": p.get("query_start_loc", []),
            "seq_lens": p.get("seq_lens", []),
            "slot_mapping": p.get("slot_mapping") or _EMPTY,
            "logits_indices": p.get("logits_indices", []),
            "sampled_token_ids": sampled,
        }
