"""The order in which differences are told: by step, then by the data flow inside that step.

When several things differ at the first divergent step, most are consequences of one. Within a step the
data flows: the scheduler decides (scheduler.*), the KV manager places blocks (kv.*), the runner builds its
inputs (runner.*) and the attention metadata (attention.*), then the model runs layer by layer (the
embedding, then per layer: qkv, the KV write, attention, o_proj, the MLP or the MoE's router, routing and
experts), the final norm and the logits, and last the sampler picks tokens (runner.sampled_token_ids; with
speculative decoding, spec_decode.*: the drafts it accepted, and those proposed after the step).
The headline is the earliest of these, so a wrong layer-0 attention output is named before the layer-1
routing change and the sampled token that follow from it.
"""

from __future__ import annotations

import re

from vllm_tour.compare.divergence import Divergence
from vllm_tour.compare.tolerance import TensorStat

_LAYER = re.compile(r"layers[.\[](\d+)")
AFTER_LAYERS = 10**6  # the final norm, the LM head and the logits come after every layer

# op -> its place inside one decoder layer (a name matches the first op it contains)
_LAYER_OPS = (
    ("qkv_proj", 0), ("kv_blocks", 1), ("attn_out", 2),
    ("all_reduce_in.model.layers.{}.self_attn.o_proj", 3), ("o_proj", 4),
    ("gate_up_proj", 5), ("router_logits", 5),
    ("topk_ids", 6), ("topk_weights", 6), ("tokens_per_expert", 6), ("moe.layers", 6),
    ("moe_partial", 7), ("all_reduce_in.model.layers.{}.mlp.down_proj", 7), ("all_reduce_in.model.layers.{}.mlp.experts", 7),
    ("down_proj", 8), ("moe_out", 8), ("mlp.experts", 8),
)
_STAGES = {"scheduler": 0, "kv": 1, "runner": 2, "attention": 3}
MODEL, SAMPLER, CRASH = 4, 5, 6


def _rank(name: str) -> int:
    m = re.search(r"rank\[?(\d+)", name)
    return int(m.group(1)) if m else 0


def model_position(name: str) -> tuple[int, int]:
    """(layer, op) of a tensor or MoE decision inside the model's forward."""
    if "embed_tokens" in name:
        return -1, 0 if "_in." in name else 1
    if "final_hidden" in name:
        return AFTER_LAYERS, 0
    if "logits" in name and "router_logits" not in name:
        return AFTER_LAYERS, 1 if "_in." in name else 2
    m = _LAYER.search(name)
    if not m:
        return AFTER_LAYERS, 9
    layer = int(m.group(1))
    for op, pos in _LAYER_OPS:
        if op.format(layer) in name:
            return layer, pos
    return layer, 9


def flow_key(d: Divergence) -> tuple:
    """Sort key: step (outputs, with no step, last), then the stage of the step, then the model position and rank."""
    step = (1, 0) if d.step is None else (0, d.step)
    if d.kind == "crash":
        return (*step, CRASH, 0, 0, 0)
    if d.kind == "missing" and d.field == "step":
        return (*step, -1, 0, 0, 0)
    head = d.field.split(".", 1)[0].split("[", 1)[0]
    if head == "runner" and d.field.startswith("runner.sampled_token_ids"):
        return (*step, SAMPLER, 0, 0, 0)
    if head == "spec_decode":  # the sampler's verification of the drafts, then the drafts proposed after it
        return (*step, SAMPLER, 1, 0, 0)
    if head in _STAGES:
        return (*step, _STAGES[head], 0, 0, 0)
    if d.kind == "tokens":
        return (*step, SAMPLER, 1, 0, 0)
    layer, op = model_position(d.field)
    return (*step, MODEL, layer, op, _rank(d.field))


def tensor_divergence(s: TensorStat) -> Divergence:
    """An out-of-tolerance tensor as a divergence, to be ordered among the decisions."""
    if s.max_abs == float("inf"):
        msg = s.note
    else:
        msg = (f"max |Δ| {s.max_abs:.3g} > atol {s.atol:g} + rtol {s.rtol:g}·|upstream| (failed: {', '.join(s.failed)})"
               + (f"; {s.note}" if s.note else ""))
    return Divergence("tensor", s.step, s.name, None, None, None, f"tensor {s.name} out of tolerance at step {s.step}: {msg}")


def ordered(divergences: list[Divergence], bad_tensors: list[TensorStat]) -> list[Divergence]:
    """Every divergence and every out-of-tolerance tensor of a step (the first per name; pooled ones, with no
    step, are not a step's), in data-flow order; the same field is told once, its first time."""
    named = {d.field for d in divergences}
    first_bad: dict[str, TensorStat] = {}
    for s in bad_tensors:
        if s.step is not None and s.name not in named:
            if s.name not in first_bad or s.step < first_bad[s.name].step:
                first_bad[s.name] = s
    items = list(divergences) + [tensor_divergence(s) for s in first_bad.values()]
    return sorted(items, key=flow_key)  # stable: equal keys keep the order they were found in
