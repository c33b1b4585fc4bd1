"""Expert parallelism: the experts of each MoE layer split over ranks, simulated in one process.

Upstream counterparts (v0.32.0):
- `vllm.model_executor.layers.fused_moe.config.FusedMoEParallelConfig.make` (EP is on when
  `enable_expert_parallel` and dp * pcp * tp > 1: the MoE layer then sees tp_size=1 and
  ep_size = dp * pcp * tp, so every rank holds whole experts instead of a slice of each)
- `vllm.model_executor.layers.fused_moe.expert_map_manager.determine_expert_map` (placement)
- `vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._maybe_reduce_final_output`
  (DP = 1: the all-reduce of the ranks' partial outputs)
- `vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._maybe_dispatch` / `_maybe_combine`
  and `vllm.distributed.device_communicators.all2all` (DP > 1: dispatch and combine)

Placement. With E experts on N ranks, each rank gets E // N (the first E % N ranks one more).
"linear" gives rank r a contiguous run; "round_robin" (upstream: only for models with grouped experts)
gives rank r the experts r, r + N, ... An expert map per rank translates a global expert id to the
slot of that expert's weights on this rank, -1 when another rank holds it: 4 experts on 2 ranks,
linear: rank 0 [0, 1, -1, -1], rank 1 [-1, -1, 0, 1].

Flow with DP = 1 (`expert_parallel_moe`): the ranks are one TP group, and every rank already has every
token (attention ran tensor-parallel and all-reduced). So no token moves: every rank routes all tokens
(the gate is replicated), runs only its local experts on the tokens routed to them (a token whose
experts live elsewhere contributes zeros here), and the all-reduce sums the partial outputs. Because
each (token, expert) pair is computed on exactly one rank, the sum equals the one-device block.

Flow with DP > 1 (`dispatch_combine_moe`): each DP rank holds different tokens (its own requests).
Its tokens' (token, expert) pairs are *dispatched* to the ranks holding those experts (all-to-all),
each rank runs its experts on what it received, and the results are sent back and *combined*
(weighted sum per token) on the token's own rank. Upstream's default all2all backend,
allgather_reducescatter, does the same with an all-gather of tokens and a reduce-scatter of outputs.
Both flows give the one-device block's numbers; they differ in what crosses the wire.
"""

from __future__ import annotations

import torch

from .moe import Expert, MoEOutput, RankPart, route, run_experts

PLACEMENTS = ("linear", "round_robin")


def determine_expert_map(ep_size: int, ep_rank: int, num_experts: int, placement: str = "linear") -> tuple[int, list[int] | None]:
    """(number of local experts, expert map) for one rank; (num_experts, None) without EP."""
    if ep_size == 1:
        return num_experts, None
    base, extra = divmod(num_experts, ep_size)
    local = base + 1 if ep_rank < extra else base
    if placement == "linear":
        start = ep_rank * base + min(ep_rank, extra)
        mine = list(range(start, start + local))
    elif placement == "round_robin":
        mine = list(range(ep_rank, num_experts, ep_size))
    else:
        raise ValueError(f"unknown placement {placement!r} (known: {', '.join(PLACEMENTS)})")
    expert_map = [-1] * num_experts
    for slot, g in enumerate(mine):
        expert_map[g] = slot
    return local, expert_map


def local_experts(experts: list[Expert], expert_map: list[int] | None) -> list[Expert]:
    """The experts whose weights a rank loads, in slot order (upstream's weight loader skips the rest)."""
    if expert_map is None:
        return list(experts)
    slots = sorted((slot, g) for g, slot in enumerate(expert_map) if slot >= 0)
    return [experts[g] for _, g in slots]


def expert_parallel_moe(h: torch.Tensor, gate_weight: torch.Tensor, experts: list[Expert], top_k: int, renormalize: bool,
                        ep_size: int = 2, placement: str = "linear") -> MoEOutput:
    """EP with DP = 1: every rank routes all tokens, runs its local experts, the partials are all-reduced."""
    routing = route(h, gate_weight, top_k, renormalize)  # identical on every rank: same tokens, same gate
    ranks = []
    for rank in range(ep_size):
        _, expert_map = determine_expert_map(ep_size, rank, len(experts), placement)
        partial, counts = run_experts(h, routing, local_experts(experts, expert_map), expert_map)
        ranks.append(RankPart(expert_map, counts, partial))
    out = all_reduce([r.partial for r in ranks])
    return MoEOutput(out, routing, ranks)


def all_reduce(partials: list[torch.Tensor]) -> torch.Tensor:
    """Sum over ranks (in fp32, rounded once: upstream's CPU SHM all-reduce sums bf16 in fp32 too)."""
    return torch.stack([p.float() for p in partials]).sum(0).to(partials[0].dtype)


def dispatch_combine_moe(token_shards: list[torch.Tensor], gate_weight: torch.Tensor, experts: list[Expert], top_k: int,
                         renormalize: bool, placement: str = "linear") -> list[torch.Tensor]:
    """EP with DP > 1, one rank per token shard: route locally, dispatch (token, expert) pairs to the
    experts' ranks, compute there, send back and combine on the token's rank. Returns each shard's output."""
    ep_size = len(token_shards)
    identity = list(range(len(experts)))  # one rank: every expert local, in order
    maps = [determine_expert_map(ep_size, r, len(experts), placement)[1] or identity for r in range(ep_size)]
    owner = [next(r for r in range(ep_size) if maps[r][g] >= 0) for g in range(len(experts))]
    routings = [route(h, gate_weight, top_k, renormalize) for h in token_shards]
    # dispatch: inbox[dst] collects (source rank, token row, k, the token's hidden state) for dst's experts
    inbox: list[list[tuple[int, int, int, torch.Tensor]]] = [[] for _ in range(ep_size)]
    for src, (h, routing) in enumerate(zip(token_shards, routings)):
        for t, row in enumerate(routing.ids.tolist()):
            for k, g in enumerate(row):
                inbox[owner[g]].append((src, t, k, h[t]))
    # each rank computes its experts on what it received; the results travel back (the combine's all-to-all)
    returned: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(ep_size)]
    for dst in range(ep_size):
        mine = local_experts(experts, maps[dst])
        for src, t, k, x in inbox[dst]:
            g = int(routings[src].ids[t, k])
            returned[src].append((t, k, mine[maps[dst][g]](x.unsqueeze(0))[0]))
    outs = []
    for src, h in enumerate(token_shards):
        out = torch.zeros(h.shape, dtype=torch.float32)
        for t, k, y in returned[src]:
            out[t] += y.float() * routings[src].weights[t, k]
        outs.append(out.to(h.dtype))
    return outs
