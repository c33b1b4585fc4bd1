"""Async scheduling (reimpl/async_scheduler.py + FastEngine(async_scheduling=True)) on the CPU, fp32.

Scheduling step t+1 before step t's tokens are back must not change what is
generated: the same greedy tokens as the plain loop, through arrivals,
chunked prefill, prefix hits, preemption and EOS stops. And it must really
overlap: schedule(t+1) runs before update(t).
"""

from __future__ import annotations

import pytest
import torch

from reimpl.config import EngineConfig, RequestIn
from reimpl.fast_engine import FastEngine, FastQwen3
from vllm_tour.upstream.models import resolve_model


@pytest.fixture(scope="module")
def model():
    return FastQwen3.from_dir(resolve_model("tiny-qwen3"), device="cpu", dtype=torch.float32)


def _requests(eos=None):
    shared = [(5 * j) % 290 + 3 for j in range(40)]  # two requests share a 40-token prefix: prefix hits
    reqs = [RequestIn(f"r{i}", [(7 * i + j) % 300 + 1 for j in range(20 + 9 * i)], 8 + 3 * i, arrival_step=i // 3,
                        eos_token_id=eos) for i in range(9)]
    reqs += [RequestIn(f"s{i}", shared + [11 + i, 12 + i], 10, arrival_step=2 + i, eos_token_id=eos) for i in range(2)]
    return reqs


def _run(model, async_scheduling: bool, num_blocks: int, eos=None):
    """Tokens, preemption count, scheduled tokens per request, and the order of schedule/update calls."""
    eng = FastEngine(model, EngineConfig(block_size=16, num_blocks=num_blocks, max_num_batched_tokens=64, max_num_seqs=6,
                                         max_model_len=512, cuda_graphs=False, async_scheduling=async_scheduling))
    calls = []
    sched = eng.scheduler
    schedule, update = sched.schedule, sched.update_from_output

    def logged_schedule():
        out = schedule()
        calls.append(("S", out.step))
        return out

    def logged_update(out, sampled):
        calls.append(("U", out.step))
        return update(out, sampled)

    sched.schedule, sched.update_from_output = logged_schedule, logged_update
    scheduled: dict[str, int] = {}
    outs = eng.generate(_requests(eos), on_step=lambda out, _s: [
        scheduled.__setitem__(s.req_id, scheduled.get(s.req_id, 0) + s.num_tokens) for s in out.scheduled])
    return outs, eng.stats.preemptions, scheduled, calls


@pytest.mark.parametrize("num_blocks", [200, 14], ids=["roomy", "preempting"])
def test_async_generates_what_the_plain_loop_generates(model, num_blocks):
    sync_out, sync_pre, sync_sched, sync_calls = _run(model, False, num_blocks)
    async_out, async_pre, async_sched, async_calls = _run(model, True, num_blocks)
    assert async_out == sync_out
    assert all(len(v) == r.max_tokens for v, r in zip(sync_out.values(), _requests()))
    if num_blocks == 14:
        assert sync_pre > 0 and async_pre > 0  # the scenario really preempts, in both loops
    else:
        # Length stops are known ahead: async runs no extra step for them (upstream's skip in schedule()).
        assert async_sched == sync_sched
    # the plain loop: S1 U1 S2 U2 ...; async: S1 S2 U1 S3 U2 ...
    assert all(a[0] != b[0] for a, b in zip(sync_calls, sync_calls[1:]))
    overlapped = [i for i, (kind, step) in enumerate(async_calls) if kind == "U" and async_calls[i - 1] == ("S", step + 1)]
    assert len(overlapped) > 0.8 * sum(k == "U" for k, _ in async_calls)


def test_async_eos_stop_discards_the_extra_step(model):
    """A request that stops on EOS in step t was already given step t+1: its token is dropped."""
    plain, _, _, _ = _run(model, False, 200)
    eos = plain["r4"][3]  # a token the model really produces: r4 stops after its 4th token
    sync_out, _, sync_sched, _ = _run(model, False, 200, eos=eos)
    async_out, _, async_sched, _ = _run(model, True, 200, eos=eos)
    assert async_out == sync_out
    assert len(sync_out["r4"]) == 4 and sync_out["r4"][-1] == eos
    stopped_early = [rid for rid, toks in sync_out.items() if toks and toks[-1] == eos]
    assert all(async_sched[r] == sync_sched[r] + 1 for r in stopped_early)  # one wasted step each
