"""MoE under tensor parallelism without expert parallelism: upstream's TP=2 run of tiny-qwen3-moe (every rank
holds a slice of every expert), compare reimpl.tp_moe against it, and reimpl/tp_moe.py broken on purpose (each
must exit 1 naming rank and layer).

One upstream TP=2 run (tp_moe: 4 experts, top-2, moe_intermediate 128, so 64 channels of each expert per rank;
a step that mixes a prefill and a decode) serves every test here through the compare cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from reimpl import tp, tp_moe
from vllm_tour.compare import harness
from vllm_tour.compare.pytest_plugin import assert_matches_upstream
from vllm_tour.scenario import load_scenario
from vllm_tour.trace.reader import load_run

SCENARIO = "tp_moe"
MOE = [f"model.layers.{i}.mlp.experts" for i in range(2)]
REDUCED = ["model.embed_tokens"] + [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.experts")]
W13, W2 = "experts.routed_experts.w13_weight", "experts.routed_experts.w2_weight"


def test_probes_record_the_sharded_experts_and_their_all_reduce(upstream_run):
    run = load_run(upstream_run(SCENARIO).run_dir)
    shards = {r: {s.name: s for s in rec.shards} for r, rec in run.tp_shards.items()}
    assert sorted(shards) == [0, 1]
    for rank in (0, 1):
        # every expert on every rank, a slice of each: w13 [experts, 2 * 128 / 2, hidden], w2 [experts, hidden, 128 / 2]
        assert shards[rank][f"model.layers.0.mlp.{W13}"].shape == [4, 128, 256]
        assert shards[rank][f"model.layers.0.mlp.{W2}"].shape == [4, 256, 64]
    assert shards[0]["model.layers.0.mlp.gate.weight"].sha256 == shards[1]["model.layers.0.mlp.gate.weight"].sha256
    assert shards[0][f"model.layers.0.mlp.{W2}"].sha256 != shards[1][f"model.layers.0.mlp.{W2}"].sha256
    mixed = 0
    for step in run.steps:
        for rank in (0, 1):
            # the MoE block's all-reduce is named by its layer (probes/moe.py), not "?"
            assert [(c.op, c.layer) for c in step.collectives[rank]] == [("all_reduce", x) for x in REDUCED] + [("all_gather", "logits")]
            assert all(r.expert_map is None and r.num_local_experts == 4 for r in step.moe[rank])
        assert [c.sha256_out for c in step.collectives[0]] == [c.sha256_out for c in step.collectives[1]]
        names = {(c.proc.rank, c.name) for c in step.captures}
        assert {(r, f"{kind}.layers.{i}") for r in (0, 1) for i in (0, 1) for kind in ("moe_partial", "router_logits")} <= names
        mixed += len(step.runner[0].req_ids) == 2 and max(step.runner[0].num_scheduled_tokens) > 1
    assert mixed  # a step runs b's prefill beside a's decode


def test_compare_tp_moe_clean(compare_upstream):
    r = compare_upstream("reimpl.tp_moe", SCENARIO)
    assert_matches_upstream(r)
    judged = {t.name for t in r.tensors if t.step is not None}
    for rank in (0, 1):
        for i, layer in enumerate(MOE):
            assert {f"rank{rank}/tp.all_reduce_in.{layer}", f"rank{rank}/tp.all_reduce_out.{layer}",
                    f"rank{rank}/moe_partial.layers.{i}", f"rank{rank}/router_logits.layers.{i}"} <= judged
    assert r.steps_upstream == 5


def _first(r):
    assert r.exit_code == 1
    return r.first


def test_w2_shard_from_the_wrong_slice(compare_upstream, monkeypatch):
    """Rank 1 loads rank 0's columns of every expert's down_proj: its weight shard and its MoE partial are named;
    rank 0's partial stays right."""
    row_shard = tp_moe.row_shard
    monkeypatch.setattr(tp_moe, "row_shard", lambda w, rank, world: row_shard(w, 0, world))
    r = compare_upstream("reimpl.tp_moe", SCENARIO)
    f = _first(r)
    assert f.step == 0 and f.field == f"tp.shards[rank1].model.layers.0.mlp.{W2}.sha256"
    assert f.message.startswith("rank 1, layer model.layers.0.mlp.experts.routed_experts, tensor w2_weight (weight shard)")
    partial = next(d for d in r.divergences if d.field == "rank1/moe_partial.layers.0")
    assert partial.step == 1 and partial.message.startswith(
        "rank 1, layer model.layers.0.mlp.experts, tensor moe_partial (this rank's MoE output over its expert slices")
    assert all(t.ok for t in r.tensors if t.step == 1 and t.name == "rank0/moe_partial.layers.0")


def test_w13_cut_as_one_contiguous_slice(compare_upstream, monkeypatch):
    """Each expert's [gate; up] cut as one matrix (rank 0 all of gate, rank 1 all of up) instead of each cut on its own."""
    monkeypatch.setattr(tp_moe, "merged_column_shard", lambda ws, rank, world: tp.column_shard(torch.cat(ws), rank, world))
    f = _first(compare_upstream("reimpl.tp_moe", SCENARIO))
    assert f.step == 0 and f.field == f"tp.shards[rank0].model.layers.0.mlp.{W13}.sha256"
    assert "rank 0, layer model.layers.0.mlp.experts.routed_experts, tensor w13_weight (weight shard), step 0" in f.message


def test_one_rank_doubles_its_partial_into_the_all_reduce(compare_upstream, monkeypatch):
    """Rank 1 hands the MoE all-reduce twice its partial: the experts' output itself is right (moe_partial), what
    went into the collective is not; the headline is rank 1's all-reduce input at layer 0, before what it fed."""
    all_reduce = tp.SimulatedGroup.all_reduce

    def doubled(self, parts, layer):
        return all_reduce(self, [parts[0], parts[1] * 2] if layer.endswith("mlp.experts") else parts, layer)

    monkeypatch.setattr(tp.SimulatedGroup, "all_reduce", doubled)
    r = compare_upstream("reimpl.tp_moe", SCENARIO)
    f = _first(r)
    assert f.step == 1 and f.field == "rank1/tp.all_reduce_in.model.layers.0.mlp.experts"
    assert f.message.startswith("rank 1, layer model.layers.0.mlp.experts, tensor all_reduce_in (partial sum into the all-reduce)")
    assert all(t.ok for t in r.tensors if t.step == 1 and t.name.endswith("moe_partial.layers.0"))
    assert not any(t.ok for t in r.tensors if t.step == 1 and t.name.endswith("tp.all_reduce_out.model.layers.0.mlp.experts"))


def test_modules_take_only_their_kind_of_model():
    moe_tp, dense_tp, moe_one = (load_scenario(harness.SCENARIOS_DIR / f"{n}.toml") for n in (SCENARIO, "tp_single", "cmp_moe_single"))
    assert harness.applicable(moe_tp, "reimpl.tp_moe") is None
    assert "reimpl.tp_moe compares MoE TP=2" in harness.applicable(moe_tp, "reimpl.tp")
    assert "reimpl.tp_moe compares MoE TP=2" in harness.applicable(moe_tp, "reimpl.ep")
    assert "is dense" in harness.applicable(dense_tp, "reimpl.tp_moe")
    assert "reimpl.tp_moe compares TP=2 runs only" in harness.applicable(moe_one, "reimpl.tp_moe")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs 2 GPUs (the 2-GPU machine)"))])
def test_distributed_ranks_equal_the_simulation(tmp_path, backend):
    """TPQwen3MoE's rank code in 2 processes over torch.distributed (gloo; NCCL with the collectives on 2 GPUs)
    computes what the simulation does, bit for bit (two-term sums are exact in any order), MoE partials included."""
    from vllm_tour.upstream.models import make_tiny_model

    sys.path.insert(0, str(Path(__file__).parent))
    from _tp_batch import run_batch, run_ranks

    model_dir = make_tiny_model("tiny-qwen3-moe")
    ranks = run_ranks(model_dir, tmp_path, backend)
    sim = tp_moe.TPQwen3MoE(model_dir, tp.SimulatedGroup(2))
    run_batch(sim)
    for rank, got in enumerate(ranks):
        want = {k: v for k, v in sim.group.recorded.items() if k.startswith(f"rank{rank}/")}
        assert sorted(got) == sorted(want)
        assert {f"rank{rank}/moe_partial.layers.{i}" for i in (0, 1)} <= set(got)
        for k, t in want.items():
            assert torch.equal(got[k], t), k
