"""On a CUDA engine: the attention records' host-side values against what the kernel received.

    python -m vllm_tour.bench.host_view_check --backend FLASH_ATTN [--num-seqs 256] [--json PATH]

On CUDA the attention probe computes the slot mapping, the block-table rows (with a CUDA graph's
padding rows as rows of 0) and the sequence lengths from the runner's host state, without copying
the device tensors back (attention._host_view). This runs the overhead bench's GPU engine (the race
recipe: Qwen3-0.6B shapes, dummy weights, CUDA graphs + torch.compile, batches that shrink as
sequences finish, so most decode steps are padded up to a captured graph size) for one traced round
and, at every step, copies the metadata's device tensors back and compares them with those values.
The CPU side of the same check is tests/test_probes_host_state.py.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from vllm_tour.bench import overhead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("TRITON_ATTN", "FLASH_ATTN"), default="FLASH_ATTN")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.gpu = True

    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_tour.probes import attention
    from vllm_tour.probes.install import check_probes
    from vllm_tour.probes.run_env import PIN_ENV
    from vllm_tour.trace.writer import RECORDER as R
    from vllm_tour.upstream.pins import active_pin_tag

    tag = active_pin_tag()
    os.environ[PIN_ENV] = tag
    seen = {"steps": 0, "host_view_steps": 0, "padded_steps": 0, "max_padding_rows": 0, "mismatches": []}
    record_after = attention._build_after

    def checked(token, md, self, common_prefix_len, cm, *a, **kw):
        record_after(token, md, self, common_prefix_len, cm, *a, **kw)
        if not R.in_execute:
            return
        seen["steps"] += 1
        host = attention._host_tables(md, R.runner_pending)
        if host is None:
            return
        n, num_reqs = md.num_actual_tokens, cm.num_reqs
        slots, table, zero_rows, seq_lens = attention._host_view(host, cm, num_reqs, n)
        padded = np.concatenate([table, np.zeros((zero_rows, table.shape[1]), table.dtype)])
        seen["host_view_steps"] += 1
        seen["padded_steps"] += int(zero_rows > 0)
        seen["max_padding_rows"] = max(seen["max_padding_rows"], zero_rows)
        for name, mine, device in (("slot_mapping", slots, md.slot_mapping[:n]),
                                   ("block_table", padded, md.block_table[:num_reqs]),
                                   ("seq_lens", seq_lens, md.seq_lens[:num_reqs])):
            if not np.array_equal(mine, device.cpu().numpy()) and len(seen["mismatches"]) < 20:
                seen["mismatches"].append(f"step {R.worker_step} {name}")

    attention._build_after = checked  # the CUDA builders' probes (attention.build_probe) look it up at each call
    resolved = [r for r in check_probes(tag, backend=args.backend, tp_size=1) if not r.probe.capture_only]
    engine_args, shapes, reqs, temperature = overhead.gpu_engine_args(EngineArgs, args)
    engine = LLMEngine.from_engine_args(engine_args)
    with tempfile.TemporaryDirectory() as tmp:
        overhead.run_round(engine, reqs, SamplingParams, "check", temperature, resolved, tmp)
    result = {"engine": shapes, "pin": tag, **seen, "ok": seen["host_view_steps"] > 0 and not seen["mismatches"]}
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
