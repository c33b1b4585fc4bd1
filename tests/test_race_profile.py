"""race_profile's phase split (vllm_tour/bench/race_profile.py), run on the CPU with the mini engine.

The GPU numbers come from the H200; what is checked here is the bookkeeping: every step lands in
one bucket, the phases of a step add up to no more than the step, and the run still generates
every token (the wrappers must not change what the engine does)."""

import pytest
import torch

from reimpl.config import EngineConfig, RequestIn
from reimpl.fast_engine import FastEngine, FastQwen3
from vllm_tour.bench.race_profile import phase_profile
from vllm_tour.upstream.models import resolve_model

PHASES = ("schedule", "prepare", "launch", "gpu", "sample", "update")


def _engine():
    model = FastQwen3.from_dir(resolve_model("tiny-qwen3"), device="cpu", dtype=torch.float32)
    return FastEngine(model, EngineConfig(block_size=16, num_blocks=128, max_num_batched_tokens=64, max_num_seqs=32,
                                          max_model_len=512, cuda_graphs=False))


def _requests():
    return [RequestIn(f"r{i}", [(3 * i + j) % 200 + 1 for j in range(20 + 4 * i)], 4 + 2 * i) for i in range(24)]


def test_phases_cover_every_step_and_the_run_is_unchanged():
    plain = _engine()
    expected = plain.generate(_requests())
    eng = _engine()
    res = phase_profile(eng, _requests())
    assert res["tokens"] == sum(len(v) for v in expected.values()) == eng.stats.output_tokens
    buckets = res["buckets"]
    assert sum(b["steps"] for b in buckets.values()) == eng.stats.steps
    assert "prefill/mixed" in buckets and any(k.startswith("decode ") for k in buckets)
    for name, b in buckets.items():
        parts = sum(b.get(f"{p}_ms", 0.0) for p in PHASES)
        assert 0 < parts <= b["step_ms"] * 1.001, name
        assert b["launch_ms"] > 0 and b["sample_ms"] > 0, name
    assert eng.scheduler.requests["r23"].output_token_ids == expected["r23"]
