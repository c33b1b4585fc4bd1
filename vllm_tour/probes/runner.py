"""Probes on the model runner (worker processes): one RunnerRecord per step and rank.

Workers count `execute_model` calls; upstream makes exactly one per
`Scheduler.schedule` call (also for an empty step), so the counts line up with
the scheduler's steps. The record is assembled in three places: after
`_prepare_inputs` (the batch laid out in the runner's buffers), the attention
metadata build (slot mapping, see attention.py) and `sample_tokens` (sampled ids).
"""

from __future__ import annotations

import numpy as np

from vllm_tour.probes import capture
from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.trace.schema import int_digest
from vllm_tour.trace.writer import RECORDER as R
from vllm_tour.trace.writer import user_req_id

PINS = (*CPU_PINS, "v0.21.0")
RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"  # the CPU runner inherits these
FULL_LIMIT = 256  # lists longer than this are summarized
EDGE = 16


def int_list(values) -> dict:
    """A schema.IntList as a dict, from a 1-D integer numpy array (a copy or a view read now):
    in full up to FULL_LIMIT values, else summarized (head, tail, digest of the buffer)."""
    n = len(values)
    if n <= FULL_LIMIT:
        return {"full": values.tolist(), "length": n, "head": [], "tail": [], "sha256": None}
    return {"full": None, "length": n, "head": values[:EDGE].tolist(), "tail": values[-EDGE:].tolist(), "sha256": int_digest(values)}


_EMPTY = {"full": [], "length": 0, "head": [], "tail": [], "sha256": None}  # a schema.IntList; encoded, never mutated


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _execute_before(self, scheduler_output, *a, **kw):
    if R.worker_step == 0:
        R.rank = _tp_rank()
    R.worker_step += 1
    R.segment_boundary(R.worker_step)
    R.in_execute = True
    R.runner_pending = {"step": R.worker_step, "num_tokens": scheduler_output.total_num_scheduled_tokens}


def _execute_after(token, result, self, *a, **kw):
    R.in_execute = False
    if result is not None:  # no separate sample_tokens() call will follow
        _flush(result)


def _flush(output) -> None:
    p, R.runner_pending = R.runner_pending, None
    if p is None:
        R.flush()  # an attention record written without its runner record still reaches the file
        return
    sampled: dict[str, list[int]] = {}
    ids = getattr(output, "req_ids", None)
    tokens = getattr(output, "sampled_token_ids", None)
    if ids and isinstance(tokens, list):  # async outputs are not read: that would sync
        # Encoded before this hook returns, so no reference into the output outlives it.
        sampled = dict(zip(map(user_req_id, ids), tokens))
    req_ids = p.get("req_ids", [])
    user_ids = list(sampled) if ids == req_ids and len(sampled) == len(req_ids) else list(map(user_req_id, req_ids))
    R.write(  # a schema.RunnerRecord, as a dict (see Recorder.write)
        {
            "step": p["step"],
            "proc": R.proc_dict("worker"),
            "kind": "runner",
            "num_tokens": p["num_tokens"],
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
    )
    capture.flush(p["step"])


execute_model = Probe(
    name="runner.execute_model",
    target=f"{RUNNER}.execute_model",
    params=("self", "scheduler_output"),
    records="counts worker steps; writes the runner record when the step needs no separate sampling",
    pins=PINS,
    before=_execute_before,
    after=_execute_after,
    role="worker",
)


def _prepare_after(result, out, self, scheduler_output, num_scheduled_tokens, *a, **kw):
    p = R.runner_pending
    if p is None:
        return
    n = scheduler_output.total_num_scheduled_tokens
    num_reqs = self.input_batch.num_reqs
    p["req_ids"] = list(self.input_batch.req_ids[:num_reqs])
    # upstream's own per-request counts in batch order (scheduler_output.num_scheduled_tokens[i] for i in req_ids)
    p["num_scheduled_tokens"] = num_scheduled_tokens.tolist()
    p["input_ids"] = int_list(_array(self.input_ids.cpu, n))
    if self.positions.is_cpu:  # the CPU runner: every buffer below is a host tensor
        p["positions"] = int_list(self.positions.numpy()[:n])
        p["seq_lens"] = _values(self.seq_lens, num_reqs)
        p["logits_indices"] = _values(out[0], None)
    else:
        _device_after(p, self, out, num_scheduled_tokens, num_reqs, n)
    p["query_start_loc"] = _values(self.query_start_loc.cpu, num_reqs + 1)


def _host_exact(runner) -> bool:
    """Whether the runner's device positions and sequence lengths equal what its host
    state gives (v0.21.0 computes them on the GPU from host copies): not under async
    speculative decoding (device-side corrections) nor M-RoPE/XD-RoPE positions."""
    return not (
        getattr(runner, "use_async_spec_decode", False)
        or getattr(runner, "uses_mrope", False)
        or getattr(runner, "uses_xdrope_dim", 0) > 0
        or not hasattr(runner, "optimistic_seq_lens_cpu")
        or not hasattr(runner, "query_pos")
    )


def _device_after(p: dict, runner, out, num_scheduled, num_reqs: int, n: int) -> None:
    """CUDA: the same values from the runner's host state, not copied back from the GPU
    (each copy a device sync that also stalls async scheduling). Falls back to the
    device copy where the host state does not determine them."""
    if not _host_exact(runner):
        p["positions"] = int_list(_array(runner.positions, n))
        p["seq_lens"] = _values(runner.seq_lens, num_reqs)
        p["logits_indices"] = _values(out[0], None)
        return
    computed = runner.input_batch.num_computed_tokens_cpu
    if n == num_reqs:  # one token per request (a decode step): token i is request i's, at its computed length
        req_indices = np.arange(num_reqs)
        positions = computed[:num_reqs].astype(np.int64)
    else:
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        positions = computed[req_indices].astype(np.int64) + runner.query_pos.np[:n]
    p["positions"] = int_list(positions)
    p["seq_lens"] = runner.optimistic_seq_lens_cpu.numpy()[:num_reqs].tolist()
    if out[1] is None:  # no speculative decoding: upstream's query_start_loc[1:] - 1
        p["logits_indices"] = (runner.query_start_loc.np[1 : num_reqs + 1] - 1).tolist()
    else:
        p["logits_indices"] = _values(out[0], None)
    p["host"] = (runner, req_indices, positions)  # attention.py's slot mapping and block table


def _array(t, n: int):
    """The first n values of a tensor as numpy: a view in host memory, one copy from a GPU."""
    return t.numpy()[:n] if t.is_cpu else t[:n].cpu().numpy()


def _values(t, n: int | None) -> list[int]:
    """The first n values of a tensor as a new list: through a numpy view in host
    memory (far cheaper than torch slicing), one copy from a GPU."""
    return t.numpy()[:n].tolist() if t.is_cpu else t[:n].cpu().tolist()


prepare_inputs = Probe(
    name="runner.prepare_inputs",
    target=f"{RUNNER}._prepare_inputs",
    params=("self", "scheduler_output", "num_scheduled_tokens"),
    records="batch order, input ids, positions, query start offsets, sequence lengths, logits indices",
    pins=PINS,
    after=_prepare_after,
    role="worker",
)


def _sample_after(token, result, self, *a, **kw):
    _flush(result)


sample_tokens = Probe(
    name="runner.sample_tokens",
    target=f"{RUNNER}.sample_tokens",
    params=("self", "grammar_output"),
    records="sampled token ids per request; writes the runner record and the step's captures",
    pins=PINS,
    after=_sample_after,
    role="worker",
)

PROBES = [execute_model, prepare_inputs, sample_tokens]
