"""TP=2 goldens from two H200s (upstream vLLM 0.21.0, mp executor, one worker per GPU, TRITON_ATTN, fp32 with
TRITON_F32_DEFAULT=ieee; bf16/ in bfloat16 with top-5 logprobs), traced with the rank-aware probes by
`vllm_tour/gpu/cuda_run.sh --modules reimpl.tp` (traces/results/20261130-h200x2-v0.21.0-tp). They cannot be
re-recorded on CPU and carry no tensor captures; what is checked here: both ranks recorded their shards and
every collective, and reimpl.tp (simulated ranks, on the CPU) holds the same shard bytes per rank, makes every
decision upstream made and produces its tokens, at TP=2 and at TP=1."""

import json

import pytest

from test_golden_v0210 import V0210, _compare_golden

TP_NAMES = ("tp_single", "tp_chunked", "tp_preempt", "tp_prefix")


@pytest.mark.parametrize("name", TP_NAMES)
def test_cuda_tp_golden_records_both_ranks(name):
    d = V0210 / name
    meta = json.loads((d / "meta.json").read_text())
    assert meta["pin"] == "v0.21.0" and meta["status"] == "ok" and meta["env"] == {"TRITON_F32_DEFAULT": "ieee"}
    assert meta["engine_args"]["tensor_parallel_size"] == 2
    recs = [json.loads(line) for line in (d / "records.0.jsonl").read_text().splitlines()]
    assert "probe_error" not in {r["kind"] for r in recs}
    shards = {r["proc"]["rank"]: r for r in recs if r["kind"] == "tp_shards"}
    assert set(shards) == {0, 1} and {s["communicator"] for s in shards.values()} <= {"nccl", "cuda-custom-allreduce"}
    coll = [r for r in recs if r["kind"] == "collective"]
    for step in {r["step"] for r in recs if r["kind"] == "scheduler"}:
        per_rank = [[(c["op"], c["layer"]) for c in coll if c["step"] == step and c["proc"]["rank"] == k] for k in (0, 1)]
        assert per_rank[0] == per_rank[1] and per_rank[0], step  # the same collectives, in order, on both ranks
    assert sum(f.stat().st_size for f in d.iterdir()) < 400 << 10


@pytest.mark.parametrize("name", TP_NAMES)
def test_reimpl_tp_matches_upstream_cuda_tp2(tmp_path, name):
    """fp32: reimpl.tp's shards are upstream's bytes per rank, both upstream ranks left every all-reduce with the
    same tensor, decisions and tokens exact, and the reimpl at TP=1 gives the same tokens."""
    r = _compare_golden(tmp_path, name, module="reimpl.tp")
    assert r["status"] == "clean", r["first_divergence"]
    assert r["steps"]["upstream"] == r["steps"]["reimpl"] > 1
    # v0.21.0 runs carry no final hidden states (probes/tp.py final_hidden is v0.32.0's): said, not failed
    assert any(n["what"].startswith("each rank's final hidden states") for n in r["not_compared"])


def test_reimpl_tp_bf16_on_cpu_matches_upstream_cuda_tp2_bf16(tmp_path):
    """bf16 (tp_chunked traced in bfloat16 with top-5 logprobs): the reimpl in bf16 on the CPU holds upstream's
    shard bytes per rank and makes every decision upstream made; its greedy picks follow vLLM's top-5 rule."""
    outs = json.loads((V0210 / "bf16" / "tp_chunked" / "outputs.json").read_text())
    assert all(len(o["top_token_ids"]) == len(o["token_ids"]) > 0 for o in outs["requests"])
    r = _compare_golden(tmp_path, "tp_chunked", module="reimpl.tp", golden=V0210 / "bf16")
    assert r["status"] == "clean", r["first_divergence"]
    assert r["tolerance"]["name"] == "bf16" and r["tokens_rule"].startswith("vLLM's check_logprobs_close")
