"""One rank of reimpl/tp.py's TPQwen3 (tp_moe.py's TPQwen3MoE for a MoE checkpoint) over torch.distributed
(gloo, or NCCL on GPU rank RANK), for tests/test_compare_tp.py and tests/test_compare_tp_moe.py.

    python tests/_tp_dist_worker.py RANK WORLD INIT_FILE MODEL_DIR OUT_DIR [gloo|nccl]
Runs one prefill of two requests and a logits gather; saves what crossed each collective on this rank
(group.recorded) to OUT_DIR/rank<RANK>.safetensors."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _tp_batch import run_batch  # this script's directory is on sys.path
from safetensors.torch import save_file

from reimpl.moe import is_moe
from reimpl.tp import DistributedGroup, TPQwen3
from reimpl.tp_moe import TPQwen3MoE

rank, world, init_file, model_dir, out_dir = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
backend = sys.argv[6] if len(sys.argv) > 6 else "gloo"
group = DistributedGroup(rank, world, backend, f"file://{init_file}")
with open(os.path.join(model_dir, "config.json")) as f:
    model_cls = TPQwen3MoE if is_moe(json.load(f)) else TPQwen3
run_batch(model_cls(model_dir, group))
save_file({k: v.contiguous() for k, v in group.recorded.items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))
group.close()
