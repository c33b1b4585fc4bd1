"""Runs the CPU overhead bench's engine (in-process, tiny-qwen3) with the runner and attention
probes also computing each step's values the way they do on CUDA (from the runner's host state),
and compares them with the tensors the CPU runner and CPU_ATTN builder hold. Prints one JSON
object on its last line for tests/test_probes_host_state.py."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from vllm_tour.bench import overhead  # noqa: E402
from vllm_tour.probes import attention, install, runner  # noqa: E402
from vllm_tour.trace.writer import RECORDER as R  # noqa: E402

seen = {"prepare": 0, "build": 0, "prefill_steps": 0, "mismatches": []}


def prepare_after(result, out, self, scheduler_output, num_scheduled_tokens, *a, **kw):
    runner._prepare_after(result, out, self, scheduler_output, num_scheduled_tokens, *a, **kw)
    p = R.runner_pending
    if p is None:
        return
    host: dict = {}
    runner._device_after(host, self, out, num_scheduled_tokens, self.input_batch.num_reqs, scheduler_output.total_num_scheduled_tokens)
    seen["mismatches"] += [f"step {p['step']} {k}" for k in ("positions", "seq_lens", "logits_indices") if host[k] != p[k]]
    seen["prepare"] += 1
    seen["prefill_steps"] += int(scheduler_output.total_num_scheduled_tokens > self.input_batch.num_reqs)
    p["host"] = host["host"]


def build_after(token, md, self, common_prefix_len, cm, *a, **kw):
    attention._build_after(token, md, self, common_prefix_len, cm, *a, **kw)
    p = R.runner_pending
    if not R.in_execute or p is None or "host" not in p:
        return
    n, num_reqs = md.num_actual_tokens, cm.num_reqs
    slots, table, zero_rows, seq_lens = attention._host_view(p["host"], cm, num_reqs, n)
    table = np.concatenate([table, np.zeros((zero_rows, table.shape[1]), table.dtype)])
    for name, host, held in (("slot_mapping", slots, md.slot_mapping.numpy()[:n]),
                             ("block_table", table, md.block_table.numpy()[:num_reqs]),
                             ("seq_lens", seq_lens, md.seq_lens.numpy()[:num_reqs])):
        if not np.array_equal(host, held):
            seen["mismatches"].append(f"step {p['step']} {name}")
    seen["build"] += 1


install.PROBES[:] = [dataclasses.replace(q, after=prepare_after) if q is runner.prepare_inputs
                     else dataclasses.replace(q, after=build_after) if q is attention.build else q
                     for q in install.PROBES]
sys.argv = ["overhead", "--rounds", "1", "--requests", "12", "--max-tokens", "6"]
overhead.main()
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

# every traced round of the bench (its warm-up, the B rounds, the timed ones) takes its probes off again
seen["probes_left_installed"] = hasattr(GPUModelRunner.execute_model, "__vllm_tour_probe__")
print(json.dumps(seen))
