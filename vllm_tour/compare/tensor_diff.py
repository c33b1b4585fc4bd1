"""Tensor diffs: upstream's captured attention outputs, KV blocks, router logits and MoE outputs against the
reimpl's, per step and layer."""

from __future__ import annotations

from ..errors import TourError
from ..probes.kv_layout import CANONICAL_LAYOUT
from . import diffs
from .diffs import TensorStat
from .upstream import load_capture


TOKEN_ROWS = ("attn_out.", "router_logits.", "moe_out.")  # one row per token of the step, in batch order


def diff_tensors(run_dir, up_steps, re_steps, re_tensors, atol, rtol) -> list[TensorStat]:
    import torch

    stats: list[TensorStat] = []
    for step in sorted(up_steps):
        caps = up_steps[step].get("captures") or []
        if not caps or step not in re_tensors:
            continue
        up_runner, re_runner = up_steps[step].get("runner"), re_steps[step].get("runner")
        for rec in caps:
            name = rec["name"]
            mine = re_tensors[step].get(name)
            if mine is None:
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
                stats.append(diffs.compare_tensor(name, step, up_t, mine, atol, rtol))
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
                stats.append(diffs.compare_tensor(name, step, up_t, mine, atol, rtol, mask,
                                                  "slots holding tokens (stale slots past each sequence end ignored)"))
    return stats


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
