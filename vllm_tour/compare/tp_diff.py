"""Tensor-parallel diffs, per rank: weight shards (bitwise), every column-parallel layer's output shard and
every collective's input and output (tolerance; the logits gather's input is each rank's logits shard, from its
own hidden states), a MoE block's router logits and partial output, upstream's own invariant that every rank
leaves an all-reduce with the same tensor, and the same of the reimpl's ranks' final hidden states.

Upstream's side comes from probes/tp.py (TPShardsRecord, CollectiveRecord, captures tp.column_out.<layer> and
tp.<op>_<in|out>.<layer> per rank) and probes/moe.py (router_logits.layers.<i>, moe_partial.layers.<i> per rank);
the reimpl's from reimpl/tp.py and tp_moe.py (model.shards per rank, group.recorded "rank<r>/<capture name>").
Every divergence names the rank, the layer, the tensor and the step (0: at load).
"""

from __future__ import annotations

from vllm_tour.compare import tolerance
from vllm_tour.compare.diffs import Divergence
from vllm_tour.compare.tolerance import TensorStat
from vllm_tour.compare.upstream import load_capture
from vllm_tour.probes.tp import digest
from vllm_tour.trace.reader import load_run

# Captures judged per rank: upstream keeps every rank's (rank 0's alone says nothing of rank 1's)
RANK_CAPTURES = ("tp.", "moe_partial.", "router_logits.")
MOE_LAYER = {"router_logits": "mlp.gate", "moe_partial": "mlp.experts"}  # the module of a MoE block a capture is of


def _split(param: str) -> tuple[str, str]:
    """model.layers.0.mlp.gate_up_proj.weight -> (model.layers.0.mlp.gate_up_proj, weight)."""
    layer, _, tensor = param.rpartition(".")
    return layer, tensor


def same_param(name: str) -> str:
    """A parameter's name on every pin: v0.32.0 keeps FusedMoE's expert weights in a RoutedExperts submodule
    (mlp.experts.routed_experts.w13_weight), v0.21.0 in the layer itself (mlp.experts.w13_weight)."""
    return name.replace(".experts.routed_experts.", ".experts.")


def diff_shards(run, shards: dict[int, dict]) -> list[Divergence]:
    """Each rank's weight shards against the reimpl's: names, shapes and sha256 (bitwise)."""
    divs = []
    for rank, rec in sorted(run.tp_shards.items()):
        mine = {same_param(k): v for k, v in shards.get(rank, {}).items()}
        for s in rec.shards:
            layer, tensor = _split(s.name)
            t = mine.get(same_param(s.name))
            where = f"rank {rank}, layer {layer}, tensor {tensor} (weight shard), step 0 (load)"
            if t is None:
                divs.append(Divergence("tensor", 0, f"tp.shards[rank{rank}].{s.name}", s.shape, None,
                                       message=f"{where}: the reimpl holds no such shard"))
            elif list(t.shape) != s.shape:
                divs.append(Divergence("tensor", 0, f"tp.shards[rank{rank}].{s.name}.shape", s.shape, list(t.shape),
                                       message=f"{where}: shape {s.shape} upstream vs {list(t.shape)} reimpl"))
            elif digest(t) != s.sha256:
                divs.append(Divergence("tensor", 0, f"tp.shards[rank{rank}].{s.name}.sha256", s.sha256[:16],
                                       digest(t)[:16], message=f"{where}: same shape {s.shape}, different bytes"))
    return divs


def rank_disagreements(run) -> list[Divergence]:
    """Upstream's invariant: after an all-reduce (or all-gather) every rank holds the same tensor."""
    divs = []
    for step in run.steps:
        by_rank = step.collectives
        if len(by_rank) < 2:
            continue
        first = min(by_rank)
        for rank, recs in sorted(by_rank.items()):
            for mine, ref in zip(recs, by_rank[first]):
                if mine.op != "gather" and mine.sha256_out != ref.sha256_out:
                    divs.append(Divergence(
                        "upstream", step.index, f"tp.{mine.op}_out.{mine.layer}[rank{rank}]", ref.sha256_out, mine.sha256_out,
                        message=f"upstream rank {rank}, layer {mine.layer}, tensor {mine.op}_out, step {step.index}: "
                                f"differs from rank {first}'s result of the same collective"))
    return divs


def _rows(name: str, up_runner: dict | None, re_runner: dict | None):
    """Row indices laying the reimpl's tensor out in upstream's batch order (tokens, or one row per request
    for the logits), or None when the orders agree or cannot be matched (then a decision divergence says why)."""
    if not up_runner or not re_runner or up_runner["req_ids"] == re_runner["req_ids"]:
        return None
    order = {rid: i for i, rid in enumerate(re_runner["req_ids"])}
    try:
        if name.endswith(".logits") or ".final_hidden." in name:  # one row per request that gives logits
            return [order[rid] for rid in up_runner["req_ids"]]
        qsl = re_runner["query_start_loc"]
        return [j for rid in up_runner["req_ids"] for j in range(qsl[order[rid]], qsl[order[rid] + 1])]
    except KeyError:
        return None


WHAT = {"final_hidden": "final hidden states, the LM head's input", "column_out": "column-parallel output shard", "all_reduce_in": "partial sum into the all-reduce",
        "all_reduce_out": "all-reduce result", "all_gather_in": "logits shard", "all_gather_out": "gathered logits",
        "gather_in": "logits shard", "gather_out": "gathered logits",
        "moe_partial": "this rank's MoE output over its expert slices, before the all-reduce",
        "router_logits": "router logits of the replicated gate"}


def _tensor_and_layer(name: str) -> tuple[str, str]:
    """tp.all_reduce_in.model.layers.0.mlp.experts -> (all_reduce_in, model.layers.0.mlp.experts);
    moe_partial.layers.0 -> (moe_partial, model.layers.0.mlp.experts)."""
    if name.startswith("tp."):
        tensor, _, layer = name[3:].partition(".")
        return tensor, layer
    tensor, _, index = name.partition(".layers.")
    return tensor, f"model.layers.{index}.{MOE_LAYER.get(tensor, 'mlp')}"


def _divergence(key: str, rank: int, step: int, st: TensorStat, atol: float, rtol: float) -> Divergence:
    op_side, layer = _tensor_and_layer(key.partition("/")[2])
    what = f"rank {rank}, layer {layer}, tensor {op_side} ({WHAT.get(op_side, op_side)}), step {step}"
    if st.max_abs == float("inf"):
        return Divergence("tensor", step, key, None, None, message=f"{what}: {st.note}")
    return Divergence("tensor", step, key, None, None,
                      message=f"{what}: max |Δ| {st.max_abs:.3g} > atol {atol:g} + rtol {rtol:g}·|upstream| "
                              f"({st.note or 'values differ'})")


def diff_collectives(run, up_steps: dict, re_steps: dict, re_tensors: dict, atol: float, rtol: float
                     ) -> tuple[list[TensorStat], list[Divergence]]:
    """Per step and rank, each captured TP tensor (column outputs, collectives) against the reimpl's, and each
    the reimpl recorded where upstream captured that rank's step; the first failure per rank as a divergence too."""
    import torch

    stats: list[TensorStat] = []
    first_bad: dict[int, Divergence] = {}
    has_final = final_hidden_recorded(run)
    for step in run.steps:
        mine_all = re_tensors.get(step.index)
        if mine_all is None:
            continue
        seen: dict[int, set[str]] = {}  # rank -> the reimpl's keys upstream captured (or could not: a gather's out)
        for rec in step.captures:
            if not rec.name.startswith(RANK_CAPTURES):
                continue
            rank = rec.proc.rank
            # the reimpl all-gathers the logits; upstream gathers them to rank 0 where use_all_gather is false (CUDA)
            key = f"rank{rank}/{rec.name.replace('tp.gather_', 'tp.all_gather_')}"
            seen.setdefault(rank, set()).add(key)
            mine = mine_all.get(key)
            if mine is None:
                stats.append(TensorStat(key, step.index, rec.shape, float("inf"), float("inf"), atol, rtol, False,
                                        f"missing: the reimpl did not produce {rec.name} on rank {rank}"))
            else:
                idx = _rows(rec.name, up_steps.get(step.index, {}).get("runner"), re_steps.get(step.index, {}).get("runner"))
                if idx is not None and len(idx) == mine.shape[0]:
                    mine = mine[torch.tensor(idx, dtype=torch.long)]
                up_t = load_capture(run.path, rec.model_dump())
                # The logits and column outputs are 256-term dot products (an LM head of gain 8): the summation
                # order alone (upstream's packed GEMM vs torch's) moves them by ~1e-5 of their scale, so the
                # absolute floor is scaled by the tensor's RMS where that exceeds 1.
                scale = max(1.0, float(up_t.double().pow(2).mean().sqrt())) if up_t.numel() else 1.0
                stats.append(tolerance.compare_tensor(key, step.index, up_t, mine, atol * scale, rtol,
                                                  note=f"atol scaled by the RMS {scale:.3g}" if scale > 1 else ""))
            if not stats[-1].ok and rank not in first_bad:
                first_bad[rank] = _divergence(key, rank, step.index, stats[-1], atol, rtol)
        for rank, keys in sorted(seen.items()):
            # a gather (not all-gather) leaves nothing on the other ranks: upstream records no out there
            keys |= {f"rank{rank}/tp.all_gather_out.{c.layer}" for c in step.collectives.get(rank, [])
                     if c.op == "gather" and c.sha256_out is None}
            if not has_final:  # a run of a pin without the probe (or recorded before it): harness notes it
                keys |= {k for k in mine_all if k.startswith(f"rank{rank}/tp.final_hidden.")}
            for key in sorted(k for k in mine_all if k.partition("/")[2].startswith(RANK_CAPTURES)
                              and k.startswith(f"rank{rank}/") and k not in keys):
                stats.append(TensorStat(key, step.index, list(mine_all[key].shape), float("inf"), float("inf"), atol,
                                        rtol, False, f"missing: upstream captured no {key.partition('/')[2]} on rank {rank}"))
                first_bad.setdefault(rank, _divergence(key, rank, step.index, stats[-1], atol, rtol))
    return stats, [first_bad[r] for r in sorted(first_bad)]


def final_hidden_recorded(run) -> bool:
    """Whether upstream captured its ranks' final hidden states (probes/tp.py final_hidden: v0.32.0 on)."""
    return any(c.name.startswith("tp.final_hidden.") for step in run.steps for c in step.captures)


def final_hidden_disagreements(re_tensors: dict) -> list[Divergence]:
    """The reimpl's ranks against each other: each leaves the model with the final hidden states of the first.

    Upstream captures its final hidden states only at the rows that give logits (and on v0.32.0 only); it
    guarantees this at every row: every rank leaves the last all-reduce with
    the same bits (rank_disagreements checks upstream's), then applies the same replicated norm. Against
    upstream itself each rank is judged by its final hidden states and its logits shard at the logits rows
    (tp.final_hidden.model.norm, tp.all_gather_in.logits); this catches a rank gone wrong after the last
    all-reduce at rows no logit reads."""
    import torch

    divs, seen = [], set()
    for step in sorted(re_tensors):
        mine = {int(k[4:].partition("/")[0]): t for k, t in re_tensors[step].items() if k.endswith("/final_hidden")}
        if len(mine) < 2:
            continue
        first = min(mine)
        for rank, t in sorted(mine.items()):
            if rank in seen or torch.equal(t, mine[first]):
                continue
            seen.add(rank)  # the first step per rank: what follows is its consequence
            delta = float((t.double() - mine[first].double()).abs().max()) if t.shape == mine[first].shape else float("inf")
            divs.append(Divergence(
                "tensor", step, f"rank{rank}/final_hidden", None, None,
                message=f"rank {rank}, layer model.norm, tensor final_hidden (hidden states after the final norm), step "
                        f"{step}: differs from rank {first}'s by up to {delta:.3g}; upstream's ranks leave the last "
                        f"all-reduce with the same sum and apply the same norm"))
    return divs


def diff_tp(run_dir, model, up_steps: dict, re_steps: dict, re_tensors: dict, atol: float, rtol: float,
            not_compared: list[dict] | None = None) -> tuple[list[Divergence], list[TensorStat]]:
    run = load_run(run_dir)
    divs = diff_shards(run, getattr(model, "shards", {}) if model is not None else {})
    divs += rank_disagreements(run)
    stats, bad = diff_collectives(run, up_steps, re_steps, re_tensors, atol, rtol)
    if not_compared is not None and not final_hidden_recorded(run):
        not_compared.append({"what": "each rank's final hidden states against upstream's (tp.final_hidden)",
                             "why": "this upstream run captured none (the probe exists from pin v0.32.0 on); the ranks "
                                    "are judged by their logits shards, and the reimpl's ranks must agree"})
    return divs + bad + final_hidden_disagreements(re_tensors), stats
