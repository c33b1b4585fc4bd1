"""The batch both the simulated and the torch.distributed TP runs of tests/test_compare_tp*.py compute, and the
two rank processes that compute it over torch.distributed (tests/_tp_dist_worker.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from reimpl.paged_attn import BatchMeta

IDS = [[5, 77, 260, 499, 12, 301, 250, 255], [256, 3, 498, 128]]  # ids on both sides of the vocab cut (256)


def run_batch(model) -> None:
    """One prefill step of two requests (blocks 1 and 2 of 32 slots), then the logits of their last tokens."""
    input_ids = [t for ids in IDS for t in ids]
    positions = [p for ids in IDS for p in range(len(ids))]
    meta = BatchMeta([0, len(IDS[0]), len(input_ids)], [len(ids) for ids in IDS], [[1], [2]],
                     [32 * (i + 1) + p for i, ids in enumerate(IDS) for p in range(len(ids))])
    with torch.no_grad():
        hidden = model.forward(input_ids, positions, meta, model.new_kv_caches(4, 32))
        model.logits(hidden[torch.tensor([len(IDS[0]) - 1, len(input_ids) - 1])])


def run_ranks(model_dir: Path, out_dir: Path, backend: str) -> list[dict[str, torch.Tensor]]:
    """run_batch in 2 processes, one rank each; what each rank recorded (group.recorded)."""
    from safetensors.torch import load_file

    worker = Path(__file__).with_name("_tp_dist_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(out_dir / "init"), str(model_dir), str(out_dir),
                               backend], stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    return [load_file(str(out_dir / f"rank{r}.safetensors")) for r in (0, 1)]
