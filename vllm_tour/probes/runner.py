"""Probes on the model runner (worker processes): one RunnerRecord per step and rank.

Workers count `execute_model` calls; upstream makes exactly one per
`Scheduler.schedule` call (also for an empty step), so the counts line up with
the scheduler's steps. The record is assembled in three places: after
`_prepare_inputs` (the batch laid out in the runner's buffers), the attention
metadata build (slot mapping, see attention.py) and `sample_tokens` (sampled ids).
"""

from __future__ import annotations

from ..trace.writer import RECORDER as R
from . import capture
from .base import Probe
from .worker_records import RUNNER

PINS = ("v0.32.0", "v0.21.0")


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
    R.in_execute = True
    R.runner_pending = (R.worker_step, scheduler_output.total_num_scheduled_tokens)
    R.host_runner = None


def _execute_after(token, result, self, *a, **kw):
    R.in_execute = False
    if result is not None:  # no separate sample_tokens() call will follow
        _flush(result)


def _flush(output) -> None:
    p, R.runner_pending = R.runner_pending, None
    if p is None:
        R.flush()  # an attention record written without its runner record still reaches the file
        return
    ids = getattr(output, "req_ids", None)
    tokens = getattr(output, "sampled_token_ids", None)
    if not (ids and isinstance(tokens, list)):  # async outputs are not read: that would sync
        ids = tokens = None
    # Handed over (encoded, or made into the record) before this hook returns: no reference into the output outlives it.
    R.send(["finish", R.proc_dict("worker"), p[0], p[1], ids, tokens], [], flush=True)
    capture.flush(p[0])


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
    if R.runner_pending is None:
        return
    n = scheduler_output.total_num_scheduled_tokens
    num_reqs = self.input_batch.num_reqs
    # num_scheduled_tokens: upstream's own per-request counts in batch order
    arrays = [num_scheduled_tokens, _array(self.input_ids.cpu, n), self.query_start_loc.cpu.numpy()[: num_reqs + 1]]
    header = ["prepare", R.proc_dict("worker"), R.worker_step, self.input_batch.req_ids[:num_reqs], "tensors", False, True]
    if self.positions.is_cpu:  # the CPU runner: every buffer below is a host tensor
        arrays += (self.positions.numpy()[:n], self.seq_lens.numpy()[:num_reqs], out[0].numpy())
    elif not _host_exact(self):
        arrays += (_array(self.positions, n), _array(self.seq_lens, num_reqs), out[0].cpu().numpy())
    else:
        # CUDA: the same values from the runner's host state, not copied back from the GPU (each copy a
        # device sync that also stalls async scheduling); worker_records computes them.
        header[5:], host = _host_arrays(self, out, n, num_reqs)
        header[4] = "host"
        arrays += host
        R.host_runner = self  # attention.py reads its block table
    R.send(header, arrays)


def _host_arrays(runner, out, n: int, num_reqs: int) -> tuple[list, list]:
    """A prepare message's host-mode flags (decode, logits indices given) and arrays (see worker_records)."""
    decode = n == num_reqs  # one token per request
    arrays = [runner.input_batch.num_computed_tokens_cpu[:num_reqs], runner.optimistic_seq_lens_cpu.numpy()[:num_reqs]]
    if not decode:
        arrays.append(runner.query_pos.np[:n])
    if out[1] is not None:  # speculative decoding: the indices as upstream made them
        arrays.append(out[0].cpu().numpy())
    return [decode, out[1] is not None], arrays


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


def _array(t, n: int):
    """The first n values of a tensor as numpy: a view in host memory, one copy from a GPU."""
    return t.numpy()[:n] if t.is_cpu else t[:n].cpu().numpy()


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
