"""One rank of reimpl/tp.py's TPQwen3 over torch.distributed (gloo), for tests/test_compare_tp.py.

    python tests/_tp_dist_worker.py RANK WORLD INIT_FILE MODEL_DIR OUT_DIR
Runs one prefill of two requests and a logits gather; saves what crossed each collective on this rank
(group.recorded) to OUT_DIR/rank<RANK>.safetensors."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file  # noqa: E402

from reimpl.tp import DistributedGroup, TPQwen3  # noqa: E402
from _tp_batch import run_batch  # noqa: E402  (this script's directory is on sys.path)

rank, world, init_file, model_dir, out_dir = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
group = DistributedGroup(rank, world, "gloo", f"file://{init_file}")
run_batch(TPQwen3(model_dir, group))
save_file({k: v.contiguous() for k, v in group.recorded.items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))
group.close()
