"""Probes on the fused-MoE layer (worker processes): routing per layer, the expert map, the outputs.

On v0.32.0 (and v0.21.0, whose runner has the same shape) a Qwen3-MoE block is `FusedMoE` -> `MoERunner.forward` -> the `moe_forward` custom op ->
`MoERunner._apply_quant_method` (the gate's router logits in, the router's top-k, then the experts
kernel), and back in `forward` the TP/EP all-reduce (`_maybe_reduce_final_output`). Records:

  MoERecord (one per layer, step and rank)  written by the experts kernel's probe *before* the kernel
                        runs, and flushed: the top-k ids it is handed, the local expert count (rows of
                        its weight tables) and the expert map, so a kernel that kills the worker still
                        leaves what it was given. Only forwards of engine steps are recorded.
  router_logits.layers.<i>  captures (with --capture): the gate's logits [num_tokens, num_experts]
  moe_out.layers.<i>        the MoE block's output after the all-reduce [num_tokens, hidden]
  moe_partial.layers.<i>    with TP/EP > 1: this rank's output before the all-reduce

The experts kernel differs per pin: the CPU's `CPUUnquantizedExperts` on v0.32.0, the CUDA Triton kernel
`TritonExperts` on v0.21.0 (fp32 unquantized MoE picks it); both take the same leading arguments.
"""

from __future__ import annotations

from vllm_tour.probes import tp
from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.trace.writer import RECORDER as R

PINS = (*CPU_PINS, "v0.21.0")
RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner"
CPU_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts"
TRITON_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.triton_moe.TritonExperts"
NAMES = ("router_logits", "moe_out", "moe_partial")

_layer = [-1]  # the layer whose MoE block runs now (set by the runner probe, read by the kernel probe)


def _layer_id(runner) -> int:
    # v0.21.0's runner has no layer_id, only its layer name ("model.layers.<i>.mlp.experts")
    if hasattr(runner, "layer_id"):
        return runner.layer_id
    return int(runner.layer_name.split("layers.")[1].split(".")[0])


def _apply_before(self, hidden_states, router_logits, *a, **kw):
    layer = _layer[0] = _layer_id(self)
    R.keep_capture(f"router_logits.layers.{layer}", router_logits)


apply_quant_method = Probe(
    name="moe.apply_quant_method",
    target=f"{RUNNER}._apply_quant_method",
    params=("self", "hidden_states", "router_logits"),
    records="which decoder layer's MoE block runs; the gate's router logits (only with --capture)",
    pins=CPU_PINS,
    before=_apply_before,
    role="worker",
    own_pins_only=True,
)

def _apply_before_v0210(self, layer, hidden_states, router_logits, *a, **kw):
    _apply_before(self, hidden_states, router_logits)


apply_quant_method_v0210 = Probe(  # v0.21.0 passes the FusedMoE layer first (by keyword, from _forward_impl)
    name="moe.apply_quant_method",
    target=f"{RUNNER}._apply_quant_method",
    params=("self", "layer", "hidden_states", "router_logits"),
    records="which decoder layer's MoE block runs; the gate's router logits (only with --capture)",
    pins=("v0.21.0",),
    before=_apply_before_v0210,
    role="worker",
    own_pins_only=True,
)


def _counts(ids: list[list[int]], n: int) -> list[int]:
    out = [0] * n
    for row in ids:
        for e in row:
            if 0 <= e < n:  # an id out of range is kept in topk_ids, where it shows
                out[e] += 1
    return out


def _experts_before(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                    global_num_experts, expert_map, *a, **kw):
    if not R.in_execute:
        return
    ids = topk_ids.tolist()
    local = int(w1.shape[0])
    emap = expert_map.tolist() if expert_map is not None else None
    num_experts = int(global_num_experts) if global_num_experts > 0 else local
    per_expert = _counts(ids, num_experts)
    local_counts = per_expert if emap is None else [0] * local
    if emap is not None:
        for e, n in enumerate(per_expert):
            if 0 <= emap[e] < local:
                local_counts[emap[e]] += n
    R.write({  # a schema.MoERecord; flushed now: the kernel that follows may kill this process
        "step": R.worker_step, "proc": R.proc_dict("worker"), "kind": "moe", "layer": _layer[0],
        "num_tokens": len(ids), "num_experts": num_experts, "num_local_experts": local, "expert_map": emap,
        "topk_ids": ids, "topk_weights": topk_weights.float().tolist(),
        "tokens_per_expert": per_expert, "local_tokens_per_expert": local_counts,
        "kernel": f"{type(self).__name__}/{getattr(self, 'isa', '?')}",
    })


_EXPERTS_PARAMS = ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
                   "global_num_experts", "expert_map")
_EXPERTS_RECORDS = ("per layer: the top-k ids and weights the experts kernel receives, its local expert count, "
                    "the expert map, tokens per expert (global and local); written before the kernel runs")

# v0.29.0's CPUUnquantizedExperts is a FusedMoEExpertsMonolithic: apply(self, hidden_states, w1, w2, router_logits, ...)
# picks the top-k itself, so no top-k ids cross its call; from v0.30.0 on it receives them.
CPU_EXPERTS_PINS = tuple(p for p in CPU_PINS if p not in ("v0.29.0", "v0.28.0"))

cpu_experts = Probe(
    name="moe.cpu_experts",
    target=f"{CPU_EXPERTS}.apply",
    params=_EXPERTS_PARAMS,
    records=_EXPERTS_RECORDS,
    pins=CPU_EXPERTS_PINS,
    before=_experts_before,
    role="worker",
    own_pins_only=True,
)

triton_experts = Probe(
    name="moe.triton_experts",
    target=f"{TRITON_EXPERTS}.apply",
    params=_EXPERTS_PARAMS,
    records=_EXPERTS_RECORDS,
    pins=("v0.21.0",),
    before=_experts_before,
    role="worker",
    own_pins_only=True,
)


def _reduce_before(self, states, *a, **kw):
    if max(self.moe_config.tp_size, self.moe_config.ep_size) > 1:
        # copied before the call: the CPU all-reduce sums in place
        R.keep_capture(f"moe_partial.layers.{_layer_id(self)}", states)
    tp.enter_layer(self.layer_name)  # the TP all-reduce inside is this layer's (model.layers.<i>.mlp.experts)


def _reduce_after(token, result, self, *a, **kw):
    tp.leave_layer()
    R.keep_capture(f"moe_out.layers.{_layer_id(self)}", result)


reduce_final_output = Probe(
    name="moe.reduce_final_output",
    target=f"{RUNNER}._maybe_reduce_final_output",
    params=("self", "states", "trunc_size"),
    records="names the TP/EP all-reduce inside (probes/tp.py records it); the MoE output after it, and with "
            "TP/EP > 1 each rank's partial before it (only with --capture)",
    pins=PINS,
    before=_reduce_before,
    after=_reduce_after,
    role="worker",
    own_pins_only=True,
)

PROBES = [apply_quant_method, apply_quant_method_v0210, cpu_experts, triton_experts, reduce_final_output]
