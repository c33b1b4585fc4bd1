"""Qwen3-MoE under tensor parallelism without expert parallelism: every rank holds a slice of every expert.

Upstream counterparts (v0.32.0):
- `vllm.model_executor.layers.fused_moe.config.FusedMoEParallelConfig.make`: without `enable_expert_parallel`
  the MoE layer keeps tp_size = TP and ep_size = 1, so each rank holds all experts, each cut by TP
  (with it, ep.py: whole experts per rank).
- `vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts._load_w13`: expert e's gate_proj and
  up_proj, each cut on its output dim as MergedColumnParallelLinear cuts them, into `w13_weight[e]`:
  rank r holds [gate_e,r; up_e,r] (the first half of its rows gate, the second up).
- `vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts._load_w2`: expert e's down_proj cut on
  its input dim, as RowParallelLinear cuts it, into `w2_weight[e]`.
- `vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear`: the router, replicated: every rank
  scores every expert for every token and picks the same top-k.
- `vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.apply`: each rank's experts
  kernel over its slices: a partial of the block's output.
- `vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._maybe_reduce_final_output`: the
  all-reduce of the partials (`tensor_model_parallel_all_reduce`), inside the layer because
  `Qwen3MoeSparseMoeBlock` builds it with `reduce_results` left True (`FusedMoEFactory`).
Weight names are v0.32.0's (`mlp.experts.routed_experts.w13_weight`; v0.21.0: `mlp.experts.w13_weight`).

Why it sums to the one-device block: an expert is a dense MLP, silu(x·gateᵀ) * (x·upᵀ) · downᵀ. Cutting
its intermediate channels keeps each channel's gate and up on the same rank (the elementwise product
needs both), and down's matching columns: each rank's product is that expert's output from its channels,
and the sum over ranks is the whole. The routing weights multiply each expert's output, so they can be
applied per rank before the sum; the top-k is the same on every rank because the gate is not cut.
Unlike EP, no token is ever skipped on a rank: every rank computes every chosen (token, expert) pair, on
a slice.
"""

from __future__ import annotations

import torch

from .moe import Expert, MoEOutput, moe_block
from .paged_attn import paged_attention
from .tp import SimulatedGroup, TPQwen3, merged_column_shard, row_shard


def expert_slices(w13: torch.Tensor, w2: torch.Tensor) -> list[Expert]:
    """A rank's slice of each expert, read from its shards: w13[e] = [gate_e,r; up_e,r], w2[e] = down_e,r."""
    return [Expert(*w13[e].chunk(2), w2[e]) for e in range(w13.shape[0])]


class TPQwen3MoE(TPQwen3):
    """TPQwen3 with every decoder layer's MLP a sparse MoE block whose experts are sharded by TP.

    Besides TPQwen3's records, each rank keeps its router logits and its partial output per layer under
    upstream's capture names (router_logits.layers.<i>, moe_partial.layers.<i>), and `last_moe` holds
    each layer's routing and per-rank parts for the engine's MoE records."""

    def __init__(self, model_dir, group: SimulatedGroup, attention=paged_attention, dtype=torch.float32):
        super().__init__(model_dir, group, attention, dtype)
        c = self.cfg
        if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1 or c.get("shared_expert_intermediate_size"):
            raise ValueError("TPQwen3MoE runs models whose every layer is a plain sparse MoE block")
        self.top_k, self.renormalize = c["num_experts_per_tok"], bool(c.get("norm_topk_prob", True))
        self.moe = moe_block  # per rank, on its slices
        self.last_moe: dict[int, MoEOutput] = {}

    def _shard_mlp(self, w: dict, m: str, r: int, world: int) -> dict[str, torch.Tensor]:
        experts = [f"{m}experts.{e}." for e in range(self.cfg["num_experts"])]
        return {
            m + "gate.weight": w[m + "gate.weight"],  # replicated
            m + "experts.routed_experts.w13_weight": torch.stack(
                [merged_column_shard([w[x + "gate_proj.weight"], w[x + "up_proj.weight"]], r, world) for x in experts]),
            m + "experts.routed_experts.w2_weight": torch.stack([row_shard(w[x + "down_proj.weight"], r, world) for x in experts]),
        }

    def mlp(self, i: int, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Layer i's MoE block: each rank runs moe.py's one-device block on its slices of the experts (routing
        every token, as the gate is whole), then the partials are all-reduced."""
        g, m = self.group, f"model.layers.{i}.mlp."
        blocks = []
        for r, h in zip(g.ranks, hs):
            s = self.shards[r]
            experts = expert_slices(s[m + "experts.routed_experts.w13_weight"], s[m + "experts.routed_experts.w2_weight"])
            block = self.moe(h, s[m + "gate.weight"], experts, self.top_k, self.renormalize)
            g.recorded[f"rank{r}/router_logits.layers.{i}"] = block.routing.logits.clone()
            g.recorded[f"rank{r}/moe_partial.layers.{i}"] = block.out.clone()
            blocks.append(block)
        reduced = g.all_reduce([b.out for b in blocks], m + "experts")
        self.last_moe[i] = MoEOutput(reduced[0], blocks[0].routing, [b.ranks[0] for b in blocks])
        return reduced


def simulated(model_dir, world_size: int, dtype: str = "float32", attention=paged_attention) -> TPQwen3MoE:
    """Every rank in this process: the model compare runs (modules.py names it)."""
    return TPQwen3MoE(model_dir, SimulatedGroup(world_size), attention, dtype)
