"""A steady stream of requests through upstream's Scheduler alone, for the long-run benchmarks.

Driven as the scheduler-only harness drives it (vllm_tour/engine/sched_harness.py: a fabricated
model output per step). Each step a request arrives with probability `arrival_p` (48-token prompt,
a fresh id with the "-<8 hex>" suffix upstream's input processor adds, so every id is new to the
probes); finished requests are dropped, as an engine drops them.
"""

from __future__ import annotations

import gc
import os
import random

PROMPT_TOKENS = 48


def rss_bytes() -> int:
    """Resident set size of this process now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def drive(sched, steps: int, *, arrival_p: float, output_tokens: tuple[int, int], rss_at: set[int],
          id_prefix: str, seed: int = 0) -> tuple[dict[int, int], int]:
    """Run `steps` scheduler steps. (RSS in bytes after a full collection at each step of `rss_at`,
    requests still running at the end.)"""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_tour.engine.sched_harness import _model_output

    rng = random.Random(seed)
    live: dict = {}
    rss = {}
    lo, hi = output_tokens
    for step in range(1, steps + 1):
        # no draw when every step has an arrival, nor for a fixed length: the same seed gives the same requests
        if arrival_p >= 1 or rng.random() < arrival_p:
            rid = f"{id_prefix}{step}-{rng.getrandbits(32):08x}"
            params = SamplingParams(max_tokens=lo if lo == hi else rng.randint(lo, hi), temperature=0.0, ignore_eos=True)
            live[rid] = Request(request_id=rid, prompt_token_ids=[rng.randrange(5, 500) for _ in range(PROMPT_TOKENS)],
                                sampling_params=params, pooling_params=None, block_hasher=sched.tour_block_hasher)
            sched.add_request(live[rid])
        out = sched.schedule()
        chunks = {r for r in out.num_scheduled_tokens if sched.requests[r].num_computed_tokens < sched.requests[r].num_tokens}
        sched.update_from_output(out, _model_output(out, chunks, live))
        for r in [r for r, q in live.items() if q.is_finished()]:
            del live[r]
        if step in rss_at:
            gc.collect()
            rss[step] = rss_bytes()
    return rss, len(live)
