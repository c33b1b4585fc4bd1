"""Tensor parallelism: the rank-aware probes on upstream's TP=2 run, compare reimpl.tp against it, and
reimpl/tp.py's sharding rules broken on purpose (each must exit 1 naming rank, layer, tensor and step).

One upstream TP=2 run (tp_single: tiny-qwen3-tp, one KV head replicated per rank, vocab 500 padded to 512)
serves every test here through the compare cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from reimpl import qwen3, tp
from vllm_tour.compare import harness
from vllm_tour.compare.pytest_plugin import assert_matches_upstream
from vllm_tour.scenario import load_scenario
from vllm_tour.trace.reader import load_run

SCENARIO = "tp_single"
LAYERS = ["model.embed_tokens"] + [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj")]
COLUMNS = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")]


def test_probes_record_each_rank(upstream_run):
    run = load_run(upstream_run(SCENARIO).run_dir)
    assert sorted(run.tp_shards) == [0, 1]
    for rank, rec in run.tp_shards.items():
        assert rec.world_size == 2 and rec.communicator == "cpu-shm"
        shapes = {s.name: s.shape for s in rec.shards}
        # one KV head of 64 replicated: q 2 heads (128) + k 64 + v 64; vocab 500 padded to 512, 256 rows a rank
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == [256, 256]
        assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == [256, 256]
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == [512, 256]
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == [256, 128]
    # ranks hold different halves of the sharded weights, the same norms
    h0, h1 = ({s.name: s.sha256 for s in run.tp_shards[r].shards} for r in (0, 1))
    assert h0["model.layers.0.mlp.down_proj.weight"] != h1["model.layers.0.mlp.down_proj.weight"]
    assert h0["model.norm.weight"] == h1["model.norm.weight"]
    for step in run.steps:
        for rank in (0, 1):
            recs = step.collectives[rank]
            assert [(c.op, c.layer) for c in recs] == [("all_reduce", layer) for layer in LAYERS] + [("all_gather", "logits")]
        # every rank leaves each collective with the same tensor; the partial sums going in differ
        assert [c.sha256_out for c in step.collectives[0]] == [c.sha256_out for c in step.collectives[1]]
        assert step.collectives[0][1].sha256_in != step.collectives[1][1].sha256_in
        names = {(c.proc.rank, c.name) for c in step.captures}
        assert {(r, f"tp.all_reduce_in.{layer}") for r in (0, 1) for layer in LAYERS} <= names
        # each rank's column-parallel outputs, not gathered: qkv [q 2 heads; k; v] = 256 of 384, gate_up 512 of 1024
        shapes = {(c.proc.rank, c.name): c.shape for c in step.captures if c.name.startswith("tp.column_out.")}
        tokens = step.collectives[0][0].shape_in[0]
        assert shapes == {(r, f"tp.column_out.{layer}"): [tokens, 256 if layer.endswith("qkv_proj") else 512]
                          for r in (0, 1) for layer in COLUMNS}
        # each rank's own final hidden states at the rows that give logits, the same on both (the LM head's input)
        final = {c.proc.rank: c for c in step.captures if c.name == "tp.final_hidden.model.norm"}
        logits_rows = step.collectives[0][-1].shape_in[0]
        assert sorted(final) == [0, 1] and all(c.shape == [logits_rows, 256] for c in final.values())


def test_compare_tp_clean(compare_upstream):
    r = compare_upstream("reimpl.tp", SCENARIO)
    assert_matches_upstream(r)
    judged = {t.name for t in r.tensors if t.step is not None}
    for rank in (0, 1):
        for layer in LAYERS:
            assert {f"rank{rank}/tp.all_reduce_in.{layer}", f"rank{rank}/tp.all_reduce_out.{layer}"} <= judged
        assert f"rank{rank}/tp.all_gather_out.logits" in judged
        assert {f"rank{rank}/tp.column_out.{layer}" for layer in COLUMNS} <= judged
        # each rank's own final hidden states and logits shard, against upstream's same rank
        assert {f"rank{rank}/tp.final_hidden.model.norm", f"rank{rank}/tp.all_gather_in.logits"} <= judged
    assert not any(n["what"].startswith("each rank's final hidden states") for n in r.not_compared)


def _first(r):
    assert r.exit_code == 1
    return r.first


def test_gate_up_as_one_contiguous_slice(compare_upstream, monkeypatch):
    monkeypatch.setattr(tp, "merged_column_shard", lambda ws, rank, world: tp.column_shard(torch.cat(ws), rank, world))
    f = _first(compare_upstream("reimpl.tp", SCENARIO))
    assert f.step == 0 and f.field == "tp.shards[rank0].model.layers.0.mlp.gate_up_proj.weight.sha256"
    assert "rank 0, layer model.layers.0.mlp.gate_up_proj, tensor weight (weight shard), step 0" in f.message


def test_kv_heads_split_instead_of_replicated(compare_upstream, monkeypatch):
    def split(q, k, v, num_kv_heads, head_dim, rank, world):
        return torch.cat([tp.column_shard(w, rank, world) for w in (q, k, v)])

    monkeypatch.setattr(tp, "qkv_shard", split)
    f = _first(compare_upstream("reimpl.tp", SCENARIO))
    assert f.step == 0 and f.field == "tp.shards[rank0].model.layers.0.self_attn.qkv_proj.weight.shape"
    assert (f.upstream, f.reimpl) == ([256, 256], [192, 256])
    assert "rank 0, layer model.layers.0.self_attn.qkv_proj, tensor weight" in f.message


def test_vocab_padding_ignored(compare_upstream, monkeypatch):
    monkeypatch.setattr(tp, "pad_vocab", lambda vocab_size: vocab_size)
    f = _first(compare_upstream("reimpl.tp", SCENARIO))
    assert f.step == 0 and f.field == "tp.shards[rank0].model.embed_tokens.weight.shape"
    assert (f.upstream, f.reimpl) == ([256, 256], [250, 256])


def test_partial_sum_off_on_one_rank(compare_upstream, monkeypatch):
    """A wrong partial sum on rank 1 only (its down_proj output scaled): named by rank, layer, tensor, step."""
    row_parallel = tp.row_parallel

    def off(x, w, bias, rank):
        y = row_parallel(x, w, bias, rank)
        return y * 1.001 if rank == 1 and w.shape[1] == 256 else y  # down_proj's shard is [256, 256]

    monkeypatch.setattr(tp, "row_parallel", off)
    r = compare_upstream("reimpl.tp", SCENARIO)
    bad = [d for d in r.divergences if d.kind == "tensor" and d.field.startswith("rank1/")]
    assert r.exit_code == 1 and bad[0].field == "rank1/tp.all_reduce_in.model.layers.0.mlp.down_proj"
    assert bad[0].message.startswith("rank 1, layer model.layers.0.mlp.down_proj, tensor all_reduce_in (partial sum")
    assert bad[0].step == 1


def test_one_rank_skips_the_last_all_reduce(compare_upstream, monkeypatch):
    """Rank 1 goes on with its own partial sum after the last all-reduce (what crossed the collective is right):
    only its final hidden states and logits shard go wrong. Missed while every rank's logits came from rank 0's
    hidden states (issue 30); caught now by rank 1's final hidden states and logits shard against upstream's
    rank 1, and by the ranks' final hidden states disagreeing."""
    all_reduce = tp.SimulatedGroup.all_reduce
    last = "model.layers.1.mlp.down_proj"

    def skip_on_rank1(self, parts, layer):
        outs = all_reduce(self, parts, layer)  # recorded as it should be
        return [outs[0], parts[1]] if layer == last else outs

    monkeypatch.setattr(tp.SimulatedGroup, "all_reduce", skip_on_rank1)
    r = compare_upstream("reimpl.tp", SCENARIO)
    assert r.exit_code == 1
    bad = {d.field: d for d in r.divergences if d.kind == "tensor"}
    # rank 1: its final hidden states against upstream's rank 1 (and against rank 0's); rank 0's gathered logits
    # hold rank 1's shard: wrong there too, and only there on rank 0
    assert set(bad) == {"rank1/tp.final_hidden.model.norm", "rank1/final_hidden", "rank0/tp.all_gather_out.logits"}, list(bad)
    assert bad["rank1/tp.final_hidden.model.norm"].step == bad["rank1/final_hidden"].step == 1
    assert bad["rank1/tp.final_hidden.model.norm"].message.startswith(
        "rank 1, layer model.norm, tensor final_hidden (final hidden states, the LM head's input), step 1: max |Δ|")
    assert r.first.field == "rank1/tp.final_hidden.model.norm"  # before the logits it feeds
    assert not any(t.ok for t in r.tensors if t.step == 1 and t.name == "rank1/tp.all_gather_in.logits")
    assert all(t.ok for t in r.tensors if t.step == 1 and (".all_reduce_" in t.name or ".column_out." in t.name
                                                          or t.name.startswith("rank0/tp.final_hidden")
                                                          or t.name == "rank0/tp.all_gather_in.logits"))


def test_headline_names_the_rank_and_layer_before_the_token(compare_upstream, monkeypatch):
    """Rank 1's o_proj partial sum at layer 0 far off: at step 1 every later collective and the sampled tokens
    differ too; the headline is the cause (rank 1's partial into layer 0's o_proj all-reduce), not a symptom."""
    row_parallel = tp.row_parallel
    monkeypatch.setattr(tp, "row_parallel", lambda x, w, bias, rank: row_parallel(x, w, bias, rank) * (
        -4.0 if rank == 1 and w.shape[1] == 128 else 1.0))  # o_proj's shard is [256, 128]
    r = compare_upstream("reimpl.tp", SCENARIO)
    assert r.exit_code == 1
    step1 = [d.field for d in r.ordered() if d.step == 1]
    assert step1[0] == r.first.field == "rank1/tp.all_reduce_in.model.layers.0.self_attn.o_proj"
    assert step1[1] == "rank0/tp.all_reduce_out.model.layers.0.self_attn.o_proj"  # then what it fed
    assert any(f.startswith("runner.sampled_token_ids") for f in step1[2:])


def test_gate_up_output_laid_out_up_first(compare_upstream, monkeypatch):
    """Rank 0 lays its gate_up output out as [up_r; gate_r] and swaps SiLU's operands to match: every sum
    after it is bitwise the same, so only the column-parallel output itself can show the layout."""
    column_parallel, silu_and_mul = tp.column_parallel, tp.silu_and_mul

    def up_first(x, w):
        y = column_parallel(x, w)
        return torch.cat(y.chunk(2, dim=-1)[::-1], dim=-1) if w.shape[0] == 512 else y  # gate_up's shard is [512, 256]

    monkeypatch.setattr(tp, "column_parallel", up_first)
    monkeypatch.setattr(tp, "silu_and_mul", lambda gate, up: silu_and_mul(up, gate))
    r = compare_upstream("reimpl.tp", SCENARIO)
    bad = {d.field: d for d in r.divergences}
    assert r.exit_code == 1 and set(bad) == {f"rank{k}/tp.column_out.model.layers.0.mlp.gate_up_proj" for k in (0, 1)}
    d = bad["rank0/tp.column_out.model.layers.0.mlp.gate_up_proj"]
    assert d.step == 1 and d.message.startswith(
        "rank 0, layer model.layers.0.mlp.gate_up_proj, tensor column_out (column-parallel output shard), step 1: max |Δ|")
    assert all(t.ok for t in r.tensors if ".column_out." not in t.name)  # the collectives cannot see it


def test_column_output_under_another_name(compare_upstream, monkeypatch):
    """A column output the reimpl records under the unfused name (q_proj): upstream's qkv_proj is missing on the
    reimpl's side, the reimpl's q_proj on upstream's; both fail."""
    keep = tp.SimulatedGroup.keep
    monkeypatch.setattr(tp.SimulatedGroup, "keep", lambda self, rank, name, t: keep(self, rank, name.replace("qkv_proj", "q_proj"), t))
    r = compare_upstream("reimpl.tp", SCENARIO)
    failed = {(t.name, t.note.partition(":")[0]) for t in r.tensors if not t.ok and t.step == 1}
    assert r.exit_code == 1 and failed == {
        (f"rank{k}/tp.column_out.model.layers.{i}.self_attn.{p}", "missing") for k in (0, 1) for i in (0, 1)
        for p in ("qkv_proj", "q_proj")}
    d = next(d for d in r.divergences if d.field.startswith("rank1/"))
    assert d.message == ("rank 1, layer model.layers.0.self_attn.qkv_proj, tensor column_out (column-parallel output "
                         "shard), step 1: missing: the reimpl did not produce tp.column_out.model.layers.0.self_attn."
                         "qkv_proj on rank 1")


def test_bias_on_rank_zero_only():
    """Qwen3 has no row-parallel bias, so upstream cannot show this one: the rule against the unsharded layer."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    group = tp.SimulatedGroup(2)

    def sharded(rule):
        parts = [rule(tp.row_shard(x, r, 2), tp.row_shard(w, r, 2), b, r) for r in (0, 1)]
        return group.all_reduce(parts, "o_proj")[0]

    torch.testing.assert_close(sharded(tp.row_parallel), x @ w.T + b)
    both = sharded(lambda x, w, b, r: x @ w.T + b)
    torch.testing.assert_close(both - (x @ w.T + b), b.expand(3, 4))  # the bias counted twice


def test_tp1_tokens_are_checked(compare_upstream, monkeypatch):
    """The single-device reimpl must give upstream's TP=2 tokens: broken, it is named as tokens.tp1."""
    logits = qwen3.Qwen3.logits
    monkeypatch.setattr(qwen3.Qwen3, "logits", lambda self, h: -logits(self, h))
    r = compare_upstream("reimpl.tp", SCENARIO)
    assert r.exit_code == 1
    assert {d.field for d in r.divergences} == {"tokens.tp1[a]", "tokens.tp1[b]"}


def test_modules_take_only_their_world_size():
    tp_scenario, single = (load_scenario(harness.SCENARIOS_DIR / f"{n}.toml") for n in (SCENARIO, "cmp_single"))
    assert harness.applicable(tp_scenario, "reimpl.tp") is None
    assert "reimpl.tp compares TP=2" in harness.applicable(tp_scenario, "reimpl.paged_attn")
    assert "reimpl.tp compares TP=2 runs only" in harness.applicable(single, "reimpl.tp")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs 2 GPUs (the 2-GPU machine)"))])
def test_distributed_ranks_equal_the_simulation(tmp_path, backend):
    """The same rank code in 2 processes over torch.distributed (gloo; NCCL with the collectives on 2 GPUs)
    computes what the simulation does, bit for bit: two-term sums are exact in any order."""
    from vllm_tour.upstream.models import make_tiny_model

    sys.path.insert(0, str(Path(__file__).parent))
    from _tp_batch import run_batch, run_ranks

    model_dir = make_tiny_model("tiny-qwen3-tp")
    ranks = run_ranks(model_dir, tmp_path, backend)
    sim = tp.TPQwen3(model_dir, tp.SimulatedGroup(2))
    run_batch(sim)
    for rank, got in enumerate(ranks):
        want = {k: v for k, v in sim.group.recorded.items() if k.startswith(f"rank{rank}/")}
        assert sorted(got) == sorted(want) and len(got) == 2 * (len(LAYERS) + 1) + len(COLUMNS) + 2  # + final_hidden x2
        for k, t in want.items():
            assert torch.equal(got[k], t), k


def test_show_and_perfetto_put_ranks_side_by_side(upstream_run):
    from rich.console import Console

    from vllm_tour.views.perfetto import RANK_PID, to_chrome_trace
    from vllm_tour.views.show import collectives_table, tp_summary

    run = load_run(upstream_run(SCENARIO).run_dir)
    console = Console(width=200, record=True)
    console.print(collectives_table(run.steps[0]), tp_summary(run))
    text = console.export_text()
    assert "rank 0 in / out" in text and "rank 1 in / out" in text and "NO" not in text
    assert "rank 1: 19 weight tensors (10 sharded, the rest replicated) · all-reduce via cpu-shm" in text
    events = to_chrome_trace(run)["traceEvents"]
    calls = sum(len(s.collectives[0]) for s in run.steps)
    for rank in (0, 1):
        assert sum(1 for e in events if e["pid"] == RANK_PID + rank and e["ph"] == "X") == calls
    starts = {e["id"] for e in events if e["ph"] == "s" and e["pid"] == RANK_PID}
    assert starts == {e["id"] for e in events if e["ph"] == "f" and e["pid"] == RANK_PID + 1} and len(starts) == calls


def test_learners_attention_runs_on_every_rank(compare_upstream):
    """--impl paged_attention=... reaches the TP model: an attention that forgets the context shows on both ranks."""
    def last_token_only(q, k_new, v_new, cache, meta, bf16_weights=False):
        cache.write(k_new, v_new, meta.slot_mapping)
        group = q.shape[1] // v_new.shape[1]
        return v_new.repeat_interleave(group, dim=1).reshape(q.shape[0], -1)

    r = compare_upstream("reimpl.tp", SCENARIO, impl={"paged_attention": last_token_only})
    firsts = {d.field for d in r.divergences if d.kind == "tensor"}
    assert r.exit_code == 1
    assert firsts == {f"rank{k}/tp.all_reduce_in.model.layers.0.self_attn.o_proj" for k in (0, 1)}
