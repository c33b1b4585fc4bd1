"""The expert view of `show`: tokens per expert per step and layer as a small heat map, and one step's
MoE records in full (each rank's expert map and the top-k ids its experts kernel received)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from vllm_tour.trace.reader import Run, Step

MAX_ROWS = 32  # steps shown in the heat map; the rest are counted in the caption
TOPK_SHOWN = 8  # tokens of top-k ids shown per record in the step detail
# Background by share of the step's routed tokens: cold to hot.
HEAT = ("on grey11", "on grey30", "on dark_orange3", "on orange1", "on red1")


def _heat_cells(counts: list[int]) -> Text:
    total = sum(counts) or 1
    t = Text()
    for i, n in enumerate(counts):
        if i:
            t.append(" ")
        level = min(len(HEAT) - 1, int(len(HEAT) * n / total * len(counts) / 2))  # an even spread sits in the middle
        t.append(f"{n:>3}", style=("dim " if n == 0 else "bold ") + HEAT[level if n else 0])
    return t


def expert_view(run: Run) -> Table | None:
    """Steps × layers: tokens routed to each expert (rank 0's view: every rank routes the same tokens),
    and with EP each rank's local experts' counts. None when the run has no MoE records."""
    steps = [s for s in run.steps if s.moe]
    if not steps:
        return None
    first = steps[0].moe[min(steps[0].moe)]
    layers = [r.layer for r in first]
    ep = any(r.expert_map is not None for s in steps for recs in s.moe.values() for r in recs)
    shown = steps[:MAX_ROWS]
    caption = "cells: tokens routed to experts 0..E-1 in that layer (top-k: each token counts k times); hotter = larger share"
    if len(steps) > len(shown):
        caption += f"; {len(steps) - len(shown)} later steps not shown (show --step N)"
    t = Table(title=f"experts: tokens per expert per step ({first[0].num_experts} experts, {len(layers)} MoE layers"
                    + (", expert parallel" if ep else "") + ")",
              caption=caption, title_justify="left", caption_justify="left")
    t.add_column("step", justify="right")
    t.add_column("tokens", justify="right")
    for layer in layers:
        t.add_column(f"layer {layer}")
    if ep:
        t.add_column("local tokens per rank (layer " + str(layers[0]) + ")")
    for s in shown:
        recs = {r.layer: r for r in s.moe[min(s.moe)]}
        row = [str(s.index), str(next(iter(recs.values())).num_tokens)]
        row += [_heat_cells(recs[layer].tokens_per_expert) if layer in recs else Text("(not reached)", style="red")
                for layer in layers]
        if ep:
            row.append(Text("  ".join(f"r{rank} {next((r.local_tokens_per_expert for r in rs if r.layer == layers[0]), '-')}"
                                      for rank, rs in sorted(s.moe.items()))))
        t.add_row(*row)
    return t


def moe_detail(step: Step) -> list[Text]:
    out = []
    for rank, recs in sorted(step.moe.items()):
        for r in recs:
            ids = r.topk_ids[:TOPK_SHOWN]
            more = f" … ({r.num_tokens} tokens)" if r.num_tokens > TOPK_SHOWN else ""
            out.append(Text(f"MoE layer {r.layer} (rank {rank}): {r.kernel}, {r.num_local_experts}/{r.num_experts} experts local, "
                            f"expert map {r.expert_map}; tokens per expert {r.tokens_per_expert}, local {r.local_tokens_per_expert}; "
                            f"top-k ids {ids}{more}"))
    return out
