"""Probes on tensor parallelism (TP > 1), installed in every worker rank: what a rank holds, what crosses a collective.

- after the checkpoint is loaded (before process_weights_after_loading repacks it for the CPU GEMM): one TPShardsRecord per rank,
  every parameter's name, shape and sha256, and which all-reduce path the TP group runs;
- per step, per collective: a CollectiveRecord with the tensor going in (a row-parallel layer's partial
  sum, the embedding's masked lookup, the logits shard) and the one coming out (the sum, the gathered
  logits). The CPU SHM all-reduce sums *in place*, so the input is cloned before the call.
With `--capture tp` the tensors go into the step's capture file as tp.<op>_in.<layer> / tp.<op>_out.<layer>
and the shards into captures/weights.rank<r>.safetensors; so does, per step and column-parallel layer,
the rank's final hidden states at the logits rows as tp.final_hidden.model.norm (v0.32.0), and
the rank's un-gathered output shard as tp.column_out.<layer> (qkv_proj: [q_r; k_r'; v_r'], gate_up_proj:
[gate_r; up_r]; the LM head is vocab parallel, no ColumnParallelLinear: its shard is the gather's input).
No record of its own: no collective runs there, the capture is the whole story.

A collective does not know which layer called it: the row-parallel layer's and the embedding's forward
set `_layer` for the all-reduce inside them (upstream prefixes, e.g. model.layers.0.mlp.down_proj); the MoE
runner's all-reduce is named by probes/moe.py's probe on the same call (`enter_layer`, e.g.
model.layers.0.mlp.experts), since a target takes one probe.
"""

from __future__ import annotations

import hashlib

from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.trace.writer import RECORDER as R

PINS = (*CPU_PINS, "v0.21.0")
CAPTURE = "tp"

_layer: list[str] = []  # the module whose forward is running the collective (a stack: never nested today)
_world = {"size": 1, "communicator": ""}
_names: dict[int, str] = {}  # id(module) -> its name in the model, for layers without `prefix` (v0.21.0's embedding)


def digest(t) -> str:
    """sha256 of a tensor's bytes (contiguous, on the CPU)."""
    import torch

    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def communicator(group) -> str:
    """The path the TP group's all-reduce takes (vllm/distributed/device_communicators/)."""
    comm = group.device_communicator
    dist = getattr(comm, "dist_module", None)
    if dist is not None:  # CpuCommunicator: the SHM kernels in _C when every rank shares the SHM group
        return "cpu-shm" if type(dist).__name__ == "_CPUSHMDistributed" else "gloo"
    ca = getattr(comm, "ca_comm", None)
    if ca is not None and not getattr(ca, "disabled", True):
        return "cuda-custom-allreduce"
    return "nccl" if getattr(comm, "pynccl_comm", None) is not None else type(comm).__name__


def _tp_group():
    from vllm.distributed import get_tp_group

    return get_tp_group()


def _loaded_after(token, result, self, model, *a, **kw):
    group = _tp_group()
    _world["size"] = group.world_size
    if group.world_size == 1:
        return
    R.rank = group.rank_in_group
    _world["communicator"] = communicator(group)
    _names.update((id(m), name) for name, m in model.named_modules())
    params = dict(model.named_parameters())
    file = None
    if CAPTURE in R.capture:
        from safetensors.torch import save_file

        file = f"captures/weights.rank{R.rank}.safetensors"
        (R.run_dir / "captures").mkdir(exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in params.items()}, str(R.run_dir / file))
    R.write({
        "step": 0, "proc": R.proc_dict("worker"), "kind": "tp_shards", "world_size": group.world_size,
        "communicator": _world["communicator"], "file": file,
        "shards": [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "sha256": digest(v)}
                   for k, v in params.items()],
    })


weights_loaded = Probe(
    name="tp.weights_loaded",
    target="vllm.model_executor.model_loader.default_loader.DefaultModelLoader.load_weights",
    params=("self", "model", "model_config"),
    records="TP > 1: every weight shard this rank holds (name, shape, sha256) and the all-reduce path",
    pins=PINS,
    after=_loaded_after,
    role="worker", multi_rank=True,
)


def enter_layer(name: str) -> None:
    """The collectives that run until leave_layer() are `name`'s."""
    if _world["size"] > 1:
        _layer.append(name)


def leave_layer() -> None:
    if _world["size"] > 1 and _layer:
        _layer.pop()


def _enter(self, *a, **kw):
    enter_layer(getattr(self, "prefix", None) or _names.get(id(self), "?"))


def _leave(token, result, self, *a, **kw):
    leave_layer()


row_parallel = Probe(
    name="tp.row_parallel_forward",
    target="vllm.model_executor.layers.linear.RowParallelLinear.forward",
    params=("self", "input_"),
    records="names the all-reduce that follows (o_proj, down_proj)",
    pins=PINS, before=_enter, after=_leave, role="worker", multi_rank=True,
)
vocab_embedding = Probe(
    name="tp.vocab_embedding_forward",
    target="vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding.forward",
    params=("self", "input_"),
    records="names the embedding's all-reduce",
    pins=PINS, before=_enter, after=_leave, role="worker", multi_rank=True,
)


def _collective(op: str, layer: str, x_in, x_out) -> None:
    step = R.worker_step
    if not R.in_execute:
        return  # the profiling/warm-up runs before the first step
    R.write({
        "step": step, "proc": R.proc_dict("worker"), "kind": "collective", "op": op, "layer": layer,
        "shape_in": list(x_in.shape), "shape_out": None if x_out is None else list(x_out.shape),
        "dtype": str(x_in.dtype).replace("torch.", ""), "sha256_in": digest(x_in),
        "sha256_out": None if x_out is None else digest(x_out),
    }, flush=False)
    for side, t in (("in", x_in), ("out", x_out)):
        if t is not None:
            R.keep_capture(f"{CAPTURE}.{op}_{side}.{layer}", t, step)


def _reduce_before(self, input_, *a, **kw):
    if self.world_size == 1 or not self.unique_name.startswith("tp"):
        return None
    return input_.clone()  # the SHM all-reduce overwrites its input


def _reduce_after(partial, result, self, input_, *a, **kw):
    if partial is not None:
        _collective("all_reduce", _layer[-1] if _layer else "?", partial, result)


all_reduce = Probe(
    name="tp.all_reduce",
    target="vllm.distributed.parallel_state.GroupCoordinator.all_reduce",
    params=("self", "input_"),
    records="each TP all-reduce: the partial sum going in (cloned: CPU SHM reduces in place) and the sum",
    pins=PINS, before=_reduce_before, after=_reduce_after, role="worker", multi_rank=True,
)


def _gather_after(token, result, self, logits, *a, **kw):
    if _world["size"] > 1:
        _collective("all_gather" if self.use_all_gather else "gather", "logits", logits, result)


gather_logits = Probe(
    name="tp.gather_logits",
    target="vllm.model_executor.layers.logits_processor.LogitsProcessor._gather_logits",
    params=("self", "logits"),
    records="the LM head's logits shard of this rank and the gathered logits (rank 0; every rank with all-gather)",
    pins=PINS, after=_gather_after, role="worker", multi_rank=True,
)


def _final_hidden_before(self, hidden_states, *a, **kw):
    if _world["size"] > 1:  # this rank's own copy, before its LM head shard and the gather
        R.keep_capture(f"{CAPTURE}.final_hidden.model.norm", hidden_states)
    return None


final_hidden = Probe(
    name="tp.final_hidden",
    target="vllm.model_executor.layers.logits_processor.LogitsProcessor._get_logits",
    params=("self", "hidden_states"),
    records="with --capture tp: this rank's final hidden states at the rows that give logits (the LM head's input)",
    # checked against v0.32.0's source only (v0.21.0's is not on this machine): not installed on other pins,
    # where compare says the final hidden states were not compared
    pins=("v0.32.0",), own_pins_only=True,
    before=_final_hidden_before, role="worker", capture_only=True, multi_rank=True,
)


def _column_after(token, result, self, input_, *a, **kw):
    if _world["size"] == 1 or self.gather_output:
        return  # one rank, or the gathered whole: no rank's own shard to keep
    out = result[0] if isinstance(result, tuple) else result  # (output, bias) unless return_bias=False
    R.keep_capture(f"{CAPTURE}.column_out.{self.prefix}", out)


column_parallel = Probe(
    name="tp.column_parallel_forward",
    target="vllm.model_executor.layers.linear.ColumnParallelLinear.forward",
    params=("self", "input_"),
    records="with --capture tp: this rank's column-parallel output shard (qkv_proj, gate_up_proj inherit the forward)",
    pins=PINS, after=_column_after, role="worker", capture_only=True, multi_rank=True,
)

PROBES = [weights_loaded, column_parallel, row_parallel, vocab_embedding, all_reduce, final_hidden, gather_logits]
