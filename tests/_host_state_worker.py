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
os.environ["VLLM_TOUR_SPOOL"] = "0"  # the runner record made in this process, to compare with

import numpy as np  # noqa: E402

from vllm_tour.bench import overhead  # noqa: E402
from vllm_tour.probes import attention, install, runner  # noqa: E402
from vllm_tour.probes.worker_records import WorkerRecords  # noqa: E402
from vllm_tour.trace.writer import RECORDER as R  # noqa: E402

seen = {"prepare": 0, "build": 0, "prefill_steps": 0, "mismatches": []}
host = WorkerRecords()  # the records as the CUDA path makes them, from the host state alone
runners: list = []


def prepare_after(result, out, self, scheduler_output, num_scheduled_tokens, *a, **kw):
    runner._prepare_after(result, out, self, scheduler_output, num_scheduled_tokens, *a, **kw)
    if R.runner_pending is None:
        return
    n, num_reqs = scheduler_output.total_num_scheduled_tokens, self.input_batch.num_reqs
    flags, arrays = runner._host_arrays(self, out, n, num_reqs)
    host.handle(["prepare", {}, R.worker_step, [], "host", *flags],
                [num_scheduled_tokens, self.input_ids.cpu.numpy()[:n], self.query_start_loc.cpu.numpy()[: num_reqs + 1], *arrays])
    held = R.worker.runner  # made from the CPU runner's tensors (no spool helper: VLLM_TOUR_SPOOL=0)
    seen["mismatches"] += [f"step {R.worker_step} {k}" for k in ("positions", "seq_lens", "logits_indices") if host.runner[k] != held[k]]
    seen["prepare"] += 1
    seen["prefill_steps"] += int(n > num_reqs)
    runners[:] = [self]


def build_after(token, md, self, common_prefix_len, cm, *a, **kw):
    attention._build_after(token, md, self, common_prefix_len, cm, *a, **kw)
    if not R.in_execute or not runners:
        return
    n, num_reqs = md.num_actual_tokens, cm.num_reqs
    bt = runners[0].input_batch.block_table.block_tables[0]
    (block_size, batch, zero_rows, cols, width), (seq_lens, rows) = attention._host_arrays(runners[0], bt, cm, num_reqs)
    rows = np.concatenate([rows, np.zeros((len(rows), cols - width), rows.dtype)], axis=1)  # the columns not sent are 0
    slots = host._host_slots(rows, block_size, n)
    table = np.concatenate([rows[:batch], np.zeros((zero_rows, cols), rows.dtype)])
    for name, mine, held in (("slot_mapping", slots, md.slot_mapping.numpy()[:n]),
                             ("block_table", table, md.block_table.numpy()[:num_reqs]),
                             ("seq_lens", seq_lens, md.seq_lens.numpy()[:num_reqs])):
        if not np.array_equal(mine, held):
            seen["mismatches"].append(f"step {R.worker_step} {name}")
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
