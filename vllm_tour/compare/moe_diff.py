"""MoE diffs, per step and layer: routing (top-k ids exact, weights within fp32 tolerance, tokens per
expert exact) and expert placement per rank (expert map, tokens each local expert computes).

Upstream's top-k is unsorted (`torch.topk(sorted=False)` in its CPU router): each token's (id, weight)
pairs are compared sorted by id. Rows are laid out in upstream's batch order (the runner records say
where each request's tokens sit on each side).

Placement reference: where upstream ran with EP, its recorded expert map per rank. Where it ran on one
device (TP=1, expert_map None) and the reimpl simulates several ranks, the maps upstream's own
`determine_expert_map` (at the installed pin, with upstream's default placement strategy) gives for that
many ranks, and the local token counts they imply from upstream's routing.
"""

from __future__ import annotations

from vllm_tour.compare.divergence import Divergence
from vllm_tour.compare.tolerance import ATOL, RTOL


def _rows(runner: dict | None) -> dict[str, range]:
    if not runner:
        return {}
    qsl = runner["query_start_loc"]
    return {rid: range(qsl[i], qsl[i + 1]) for i, rid in enumerate(runner["req_ids"]) if i + 1 < len(qsl)}


def token_order(up_runner: dict | None, re_runner: dict | None) -> list[int] | None:
    """Reimpl row indices in upstream's batch order; None when either side's layout is unknown."""
    up_rows, re_rows = _rows(up_runner), _rows(re_runner)
    if not up_rows or set(up_rows) != set(re_rows):
        return None
    return [j for rid in up_runner["req_ids"] for j in re_rows[rid]]


def _pairs(rec: dict, order: list[int] | None) -> list[list[tuple[int, float]]]:
    rows = list(zip(rec["topk_ids"], rec["topk_weights"]))
    if order is not None and len(order) == len(rows):
        rows = [rows[j] for j in order]
    return [sorted(zip(ids, ws)) for ids, ws in rows]


def upstream_expert_map(ep_size: int, rank: int, num_experts: int) -> list[int] | None:
    """Upstream's placement for `ep_size` ranks: its determine_expert_map with the strategy it would pick
    (ParallelConfig's default, through determine_expert_placement_strategy: linear for a model without
    expert groups)."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import (
        determine_expert_map,
        determine_expert_placement_strategy,
    )

    default = ParallelConfig.__dataclass_fields__["expert_placement_strategy"].default
    strategy = determine_expert_placement_strategy(default, SimpleNamespace(use_all2all_kernels=False), None, 0, False)
    _, emap, _ = determine_expert_map(ep_size, rank, num_experts, strategy)
    return None if emap is None else emap.tolist()


def _by_layer(records: list[dict]) -> dict[int, dict[int, dict]]:
    out: dict[int, dict[int, dict]] = {}
    for r in records:
        out.setdefault(r["layer"], {})[r["proc"]["rank"]] = r
    return out


def diff_moe(step: int, up_records: list[dict], re_records: list[dict], up_runner: dict | None,
             re_runner: dict | None, reference_map=upstream_expert_map) -> list[Divergence]:
    out: list[Divergence] = []
    up, re_ = _by_layer(up_records), _by_layer(re_records)
    order = token_order(up_runner, re_runner)
    for layer in sorted(set(up) | set(re_)):
        where = f"moe.layers[{layer}]"
        if layer not in up or layer not in re_:
            out.append(Divergence("missing", step, where, layer in up, layer in re_, None,
                                  "MoE layer recorded only in " + ("upstream" if layer in up else "reimpl")))
            continue
        u, r = up[layer][min(up[layer])], re_[layer][min(re_[layer])]
        out += _diff_upstream_ranks(step, where, up[layer])
        out += _diff_routing(step, where, u, r, order)
        out += _diff_placement(step, where, up[layer], re_[layer], reference_map)
    return out


def _diff_upstream_ranks(step: int, where: str, ranks: dict[int, dict]) -> list[Divergence]:
    """Upstream's own invariant under EP: the gate is replicated and every rank routes every token, so all ranks
    hand their experts kernel the same top-k ids."""
    first = min(ranks)
    return [Divergence("decision", step, f"{where}.rank[{rank}].topk_ids", ranks[first]["topk_ids"], rec["topk_ids"], None,
                       f"upstream's rank {rank} routed the step's tokens differently from its rank {first}")
            for rank, rec in sorted(ranks.items()) if rec["topk_ids"] != ranks[first]["topk_ids"]]


def _diff_routing(step: int, where: str, u: dict, r: dict, order) -> list[Divergence]:
    up_pairs, re_pairs = _pairs(u, None), _pairs(r, order)
    up_ids = [[e for e, _ in row] for row in up_pairs]
    re_ids = [[e for e, _ in row] for row in re_pairs]
    if up_ids != re_ids:
        t = next((i for i, (a, b) in enumerate(zip(up_ids, re_ids)) if a != b), min(len(up_ids), len(re_ids)))
        return [Divergence("decision", step, f"{where}.topk_ids[{t}]", up_ids[t:t + 1], re_ids[t:t + 1], None,
                           f"token {t} (upstream batch order) routed to other experts; lengths {len(up_ids)} vs {len(re_ids)}")]
    out = []
    bad = next(((t, wu, wr) for t, (a, b) in enumerate(zip(up_pairs, re_pairs)) for (_, wu), (_, wr) in zip(a, b)
                if abs(wr - wu) > ATOL + RTOL * abs(wu)), None)
    if bad is not None:
        t, wu, wr = bad
        out.append(Divergence("tensor", step, f"{where}.topk_weights[{t}]", [w for _, w in up_pairs[t]],
                              [w for _, w in re_pairs[t]], None,
                              f"token {t}: weight {wr:.6g} vs upstream {wu:.6g}, out of |Δ| <= {ATOL:g} + {RTOL:g}·|upstream|"))
    if u["tokens_per_expert"] != r["tokens_per_expert"]:
        out.append(Divergence("decision", step, f"{where}.tokens_per_expert", u["tokens_per_expert"], r["tokens_per_expert"]))
    return out


def _diff_placement(step: int, where: str, up_ranks: dict[int, dict], re_ranks: dict[int, dict], reference_map) -> list[Divergence]:
    out = []
    first = up_ranks[min(up_ranks)]
    simulated = len(up_ranks) == 1 and first["expert_map"] is None and len(re_ranks) > 1
    for rank in sorted(re_ranks if simulated else set(up_ranks) | set(re_ranks)):
        r = re_ranks.get(rank)
        if simulated:
            emap = reference_map(len(re_ranks), rank, first["num_experts"])
            local = [0] * sum(1 for s in emap if s >= 0)
            for e, n in enumerate(first["tokens_per_expert"]):
                if emap[e] >= 0:
                    local[emap[e]] += n
            want = {"expert_map": emap, "local_tokens_per_expert": local}
        elif rank in up_ranks:
            want = {k: up_ranks[rank][k] for k in ("expert_map", "local_tokens_per_expert")}
        else:
            want = None
        if want is None or r is None:
            out.append(Divergence("missing", step, f"{where}.rank[{rank}]", want is not None, r is not None, None,
                                  "rank recorded only in " + ("upstream" if r is None else "reimpl")))
            continue
        for key in ("expert_map", "local_tokens_per_expert"):
            if want[key] != r[key]:
                src = (f"upstream's determine_expert_map for {len(re_ranks)} ranks" if simulated
                       else "upstream's recorded value")
                out.append(Divergence("decision", step, f"{where}.rank[{rank}].{key}", want[key], r[key], None,
                                      f"against {src}"))
    return out
