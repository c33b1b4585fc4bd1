"""Runs a real CPU engine (in-process, tiny-qwen3) through preemptions, prefix-cache hits and a user id
used again after its request finished, with the KV record computed at every step both ways: the fast path
(the block lists that grew since the previous record) and the full read of every list, each from the same
state; and the scheduled requests' columns both ways too (the previous record's ids, kinds and prompt
lengths reused when the same requests run in the same order, or every column read). Prints one JSON object
on its last line for tests/test_probes_kv_fast.py."""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from vllm_tour.probes import kv, scheduler  # noqa: E402
from vllm_tour.trace.writer import RECORDER as R  # noqa: E402

seen = {"steps": 0, "fast": 0, "mismatches": [], "preempted": 0, "hits": 0, "grown": 0,
        "sched_steps": 0, "sched_fast": 0, "sched_prefill_fast": 0, "sched_mismatches": []}
full_record = kv.kv_record
STATE = ("kv_prev_tables", "kv_prev_keys", "kv_prev_sizes", "kv_freed_since", "kv_prev_step", "kv_pending_freed",
         "kv_pending_evicted")


def both(scheduler, step, admitted):
    saved = {k: getattr(R, k) for k in STATE}
    keys = list(scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks)
    fast = not R.kv_freed_since and keys == R.kv_prev_keys
    R.kv_prev_tables = dict(saved["kv_prev_tables"])  # the fast path updates the previous tables in place
    R.kv_prev_keys = None  # the full read of every list
    slow = full_record(scheduler, step, admitted)
    slow_state = {k: getattr(R, k) for k in ("kv_prev_tables", "kv_prev_keys", "kv_prev_sizes")}
    for k, v in saved.items():
        setattr(R, k, v)
    record = full_record(scheduler, step, admitted)
    seen["steps"] += 1
    seen["fast"] += int(fast)
    seen["preempted"] = max(seen["preempted"], sum(r.num_preemptions for r in scheduler.requests.values()))
    seen["hits"] += len(record["prefix_hits"])
    seen["grown"] += sum(1 for uid, new in record["allocated"].items() if uid in saved["kv_prev_tables"])
    if record != slow or {k: getattr(R, k) for k in slow_state} != slow_state:
        seen["mismatches"].append(step)
    return record


kv.kv_record = both
full_scheduled = scheduler._scheduled


def scheduled_both(self, out):
    prev = R.sched_prev
    rids = [nr.req_id for nr in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
    fast = (prev is not None and not out.scheduled_new_reqs and not out.scheduled_cached_reqs.resumed_req_ids
            and rids == prev[0])
    R.sched_prev = None  # every column read
    slow = full_scheduled(self, out)
    R.sched_prev = prev
    columns = full_scheduled(self, out)
    seen["sched_steps"] += 1
    seen["sched_fast"] += int(fast)
    seen["sched_prefill_fast"] += int(fast and any(columns[0]["is_prefill"]))  # a chunked prefill going on
    if columns != slow:
        seen["sched_mismatches"].append(R.sched_step)
    return columns


scheduler._scheduled = scheduled_both

from vllm import EngineArgs, SamplingParams  # noqa: E402
from vllm.v1.engine.llm_engine import LLMEngine  # noqa: E402

from vllm_tour.bench.overhead import run_round  # noqa: E402
from vllm_tour.upstream.models import resolve_model  # noqa: E402
from vllm_tour.upstream.pins import active_pin_tag  # noqa: E402
from vllm_tour.probes.run_env import PIN_ENV  # noqa: E402
from vllm_tour.probes.install import check_probes  # noqa: E402

tag = active_pin_tag()
os.environ[PIN_ENV] = tag
resolved = [r for r in check_probes(tag, backend=None, tp_size=1) if not r.probe.capture_only]
# a 32-block cache of 32-token blocks: long decodes grow tables and preempt; shared prompt heads hit the cache;
# 64 tokens a step: prompts are prefilled in chunks while the same requests keep running
engine = LLMEngine.from_engine_args(EngineArgs(
    model=str(resolve_model("tiny-qwen3")), dtype="float32", block_size=32, kv_cache_memory_bytes=64 << 20,
    num_gpu_blocks_override=32, max_model_len=512, enforce_eager=True, enable_prefix_caching=True, max_num_seqs=16,
    max_num_batched_tokens=64, disable_log_stats=True, use_tqdm_on_load=False, seed=0))
rng = random.Random(0)
head = [rng.randrange(5, 500) for _ in range(64)]
reqs = [(head[: rng.randrange(20, 64)] + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 40))], rng.randrange(8, 160))
        for _ in range(24)]
with tempfile.TemporaryDirectory() as tmp:
    # the second round reuses the first's user ids ("r-0" ...): each one is a new request under an old name
    run_round(engine, reqs, SamplingParams, "r", 0.0, resolved, tmp)
    run_round(engine, reqs[::-1], SamplingParams, "r", 0.0, resolved, tmp)
print(json.dumps(seen))
