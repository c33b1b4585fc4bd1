"""Tensor diffs: upstream's captured attention outputs, KV blocks, router logits and MoE outputs against the
reimpl's, per step and layer.

A tensor of a judged kind that only one side produced at a step both sides captured is out of tolerance
(a reimpl that skips a layer's capture must not pass). What is not judged is returned as not-compared items."""

from __future__ import annotations

from vllm_tour.compare import tolerance
from vllm_tour.compare.tolerance import TensorStat
from vllm_tour.compare.upstream import PER_RANK_CAPTURES, load_capture
from vllm_tour.errors import TourError
from vllm_tour.probes.kv_layout import CANONICAL_LAYOUT

TOKEN_ROWS = ("attn_out.", "router_logits.", "moe_out.", "moe_partial.")  # one row per token of the step, in batch order


def capture_name(rec: dict) -> str:
    """The name a capture is judged under: a per-rank kind gets its rank (moe_partial.layers.0.rank1), as the
    reimpl names its simulated ranks' tensors."""
    if rec["name"].startswith(PER_RANK_CAPTURES):
        return f"{rec['name']}.rank{rec['proc']['rank']}"
    return rec["name"]


def diff_tensors(run_dir, up_steps, re_steps, re_tensors, atol, rtol,
                 kinds: tuple[str, ...]) -> tuple[list[TensorStat], list[dict]]:
    """kinds: the tensor kinds judged ("attn_out", "kv_blocks", "router_logits", "moe_out", "moe_partial"). Steps only one side
    ran are step divergences (diffs.diff_steps), not tensor ones. Returns (stats, not compared: [{what, why}])."""
    import torch

    stats: list[TensorStat] = []
    uncaptured: list[int] = []
    other_kinds: set[str] = set()
    for step in sorted(set(up_steps) & set(re_tensors)):
        caps = {capture_name(rec): rec for rec in up_steps[step].get("captures") or []}
        produced = {k: v for k, v in re_tensors[step].items() if "#" not in k}  # "#block_ids": side data
        if not caps:
            if produced:
                uncaptured.append(step)
            continue
        up_runner, re_runner = up_steps[step].get("runner"), re_steps[step].get("runner")
        for name in list(caps) + [n for n in produced if n not in caps]:
            if name.split(".")[0] not in kinds:
                other_kinds.add(name.split(".")[0])
                continue
            rec, mine = caps.get(name), produced.get(name)
            if rec is None or mine is None:
                lacking, shape = ("reimpl", rec["shape"]) if mine is None else ("upstream", list(mine.shape))
                other = "upstream" if lacking == "reimpl" else "reimpl"
                stats.append(TensorStat(name, step, shape, float("inf"), float("inf"), atol, rtol, False,
                                        f"missing: the {lacking} did not produce {name} at step {step} (the {other} did)"))
                continue
            up_t = load_capture(run_dir, rec)
            if name.startswith(TOKEN_ROWS) and up_runner and re_runner:
                # lay the reimpl rows out in upstream's batch order
                qsl = re_runner["query_start_loc"]
                where = {rid: (qsl[i], qsl[i + 1]) for i, rid in enumerate(re_runner["req_ids"])}
                try:
                    idx = [j for rid in up_runner["req_ids"] for j in range(*where[rid])]
                    mine = mine[torch.tensor(idx, dtype=torch.long)]
                except KeyError:
                    pass  # a batch difference: already a decision divergence; compare as is
                stats.append(tolerance.compare_tensor(name, step, up_t, mine, atol, rtol))
            elif name.startswith("kv_blocks."):
                ids = rec.get("block_ids")
                mine_ids = re_tensors[step].get(name + "#block_ids")
                mine_ids = mine_ids.tolist() if mine_ids is not None else None
                if ids is not None and mine_ids is not None and ids != mine_ids:
                    stats.append(TensorStat(name, step, list(up_t.shape), float("inf"), float("inf"), atol, rtol, False,
                                            f"different blocks written: upstream {ids} vs reimpl {mine_ids}"))
                    continue
                if rec.get("layout") != CANONICAL_LAYOUT:
                    raise TourError(f"upstream run {run_dir}: {name} at step {step} is stored as {rec.get('layout')}, "
                                    f"not {CANONICAL_LAYOUT}: it was recorded by an older vllm-tour; rerun it (--fresh)")
                mask = _valid_slots_mask(up_t, ids or mine_ids or [], re_steps[step], up_t.shape[3])
                stats.append(tolerance.compare_tensor(name, step, up_t, mine, atol, rtol, mask,
                                                  "slots holding tokens (stale slots past each sequence end ignored)"))
    not_compared = []
    if any(s.name.startswith("kv_blocks.") for s in stats):
        not_compared.append({"what": "KV cache slots past each sequence's end in the written blocks",
                             "why": "stale: a reused block keeps whatever its last owner wrote there, and neither side clears it"})
    if uncaptured:
        not_compared.append({"what": f"tensors at steps {_ranges(uncaptured)}",
                             "why": "upstream has no tensors at these steps (a run recorded with --capture-steps, or a golden: goldens keep none)"})
    for kind in sorted(other_kinds):
        not_compared.append({"what": f"{kind}.* tensors", "why": f"the module is not judged on {kind} (it judges: {', '.join(kinds)})"})
    return stats, not_compared


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def _valid_slots_mask(t, block_ids: list[int], re_step: dict, block_size: int):
    """[block, K|V, kv_head, slot, d] mask of slots that hold a token of a request scheduled this step."""
    import torch

    mask = torch.zeros(t.shape[0], block_size, dtype=torch.bool)
    pos_of = {b: i for i, b in enumerate(block_ids)}
    runner, kv = re_step.get("runner"), re_step.get("kv")
    if runner and kv:
        for rid, seq_len in zip(runner["req_ids"], runner["seq_lens"]):
            table = kv["block_tables"].get(rid, [])
            for p in range(seq_len):
                b = table[p // block_size] if p // block_size < len(table) else None
                if b in pos_of:
                    mask[pos_of[b], p % block_size] = True
    return mask[:, None, None, :, None].expand(t.shape)
