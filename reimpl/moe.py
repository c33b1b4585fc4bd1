"""The Qwen3-MoE block on one device: router, top-k, renormalisation, experts, combine.

Upstream counterparts (v0.32.0):
- `vllm.model_executor.models.qwen3_moe.Qwen3MoeSparseMoeBlock` (the block; `norm_topk_prob`
  becomes the router's `renormalize`)
- `vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear` (router logits: a bias-free
  linear layer, run inside `MoERunner._forward_impl` since the gate moved into FusedMoE)
- `vllm.model_executor.layers.fused_moe.router.cpu_router._softmax_topk` (top-k and its weights)
- `vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.apply` -> `_C.cpu_fused_moe`
  (each expert's SiLU-gated MLP over its tokens, weighted and summed per token)
- `vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._maybe_reduce_final_output`
  (the all-reduce when the experts are split over ranks: see ep.py)

A token's MLP is replaced by a weighted sum of `top_k` of `num_experts` small MLPs. The router scores
every expert (one logit each), keeps the top_k, and turns their logits into weights. With
`norm_topk_prob` (Qwen3-MoE: true) the weights are a softmax over the kept logits alone, so they sum
to 1; without it they are the full softmax's probabilities of the kept experts (summing to less).
Upstream's CPU router computes exactly those two forms; "softmax over all experts, keep top-k, divide
by their sum" is the same number written another way.

Upstream's top-k is unsorted (`torch.topk(sorted=False)`): the order of a token's experts means
nothing. Here they are sorted by weight; comparisons sort each token's (id, weight) pairs by id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .qwen3 import Qwen3
from .qwen3_numerics import silu_and_mul


@dataclass
class Routing:
    logits: torch.Tensor  # [num_tokens, num_experts] router logits
    ids: torch.Tensor  # [num_tokens, top_k] chosen global expert ids (int64)
    weights: torch.Tensor  # [num_tokens, top_k] fp32 weights, same order


@dataclass
class RankPart:
    """What one rank computed: its expert map, the tokens each local expert took, its partial output."""

    expert_map: list[int] | None  # global id -> local slot, -1 elsewhere; None: every expert is local
    local_tokens_per_expert: list[int]
    partial: torch.Tensor  # [num_tokens, hidden] before the all-reduce


@dataclass
class MoEOutput:
    out: torch.Tensor  # [num_tokens, hidden], what the block returns
    routing: Routing
    ranks: list[RankPart] = field(default_factory=list)  # one per (simulated) rank; one without EP


@dataclass
class Expert:
    gate: torch.Tensor  # [moe_intermediate, hidden]
    up: torch.Tensor  # [moe_intermediate, hidden]
    down: torch.Tensor  # [hidden, moe_intermediate]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x @ self.gate.T, x @ self.up.T) @ self.down.T


def route(h: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Router logits, the top_k experts per token, and their weights (fp32, as upstream's router)."""
    logits = h @ gate_weight.T
    top_logits, ids = torch.topk(logits.float(), top_k, dim=-1)
    if renormalize:
        weights = torch.softmax(top_logits, dim=-1)  # = softmax over all, kept, divided by their sum
    else:
        weights = (top_logits - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).exp()
    return Routing(logits, ids, weights)


def run_experts(h: torch.Tensor, routing: Routing, experts: list[Expert], expert_map: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Each expert this rank holds runs over the tokens routed to it; outputs weighted by the router
    and summed per token (the combine). `experts` are this rank's local experts; `expert_map`
    translates a global id to a local slot (-1: another rank's expert, skipped). Returns the output
    (fp32 sums, in h's dtype) and the token count per local expert."""
    out = torch.zeros(h.shape, dtype=torch.float32)
    counts = [0] * len(experts)
    for g in routing.ids.unique().tolist():
        slot = g if expert_map is None else expert_map[g]
        if slot < 0:
            continue
        token, k = (routing.ids == g).nonzero(as_tuple=True)
        counts[slot] = len(token)
        y = experts[slot](h[token]).float() * routing.weights[token, k].unsqueeze(1)
        out.index_add_(0, token, y)
    return out.to(h.dtype), counts


def moe_block(h: torch.Tensor, gate_weight: torch.Tensor, experts: list[Expert], top_k: int, renormalize: bool) -> MoEOutput:
    """The whole block on one device: every expert is local."""
    routing = route(h, gate_weight, top_k, renormalize)
    out, counts = run_experts(h, routing, experts)
    return MoEOutput(out, routing, [RankPart(None, counts, out)])


class Qwen3MoE(Qwen3):
    """Qwen3 with every decoder layer's MLP a sparse MoE block (tiny-qwen3-moe: decoder_sparse_step 1,
    no mlp_only_layers, no shared expert). `moe` is the block's function: moe_block here, ep.py's
    expert-parallel versions in compare's reimpl.ep."""

    def __init__(self, model_dir, attention=None, dtype=torch.float32, moe=moe_block):
        super().__init__(model_dir, **({"attention": attention} if attention else {}), dtype=dtype)
        c = self.cfg
        if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1 or c.get("shared_expert_intermediate_size"):
            raise ValueError("Qwen3MoE runs models whose every layer is a plain sparse MoE block")
        self.moe = moe
        self.top_k, self.renormalize = c["num_experts_per_tok"], bool(c.get("norm_topk_prob", True))
        self.experts = [[Expert(*(self.w[f"model.layers.{i}.mlp.experts.{j}.{p}_proj.weight"] for p in ("gate", "up", "down")))
                         for j in range(c["num_experts"])] for i in range(self.num_layers)]
        self.last_moe: dict[int, MoEOutput] = {}  # per layer, of the last forward (for records and captures)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        res = self.moe(h, self.w[f"model.layers.{i}.mlp.gate.weight"], self.experts[i], self.top_k, self.renormalize)
        self.last_moe[i] = res
        return res.out


def is_moe(cfg: dict) -> bool:
    return cfg.get("model_type") == "qwen3_moe" or "num_experts" in cfg
