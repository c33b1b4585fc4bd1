"""Break the reimpl on purpose: compare must exit 1 and name the first divergent step and field."""

import pytest
from typer.testing import CliRunner

from reimpl import block_pool, chunked_prefill, kv_cache_manager, paged_attn
from vllm_tour.cli import app
from vllm_tour.compare.pytest_plugin import assert_matches_upstream


def test_evict_in_wrong_order(compare_upstream, monkeypatch):
    """Free a finished request's blocks head-first: the chain's head, not its tail, is evicted first."""

    def free_head_first(self, request):
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_block.pop(request.req_id, None)
        self.block_pool.free_blocks(blocks)  # upstream: reversed(blocks)
        self.block_pool.events_freed += [b.block_id for b in blocks if b.ref_cnt == 0]

    monkeypatch.setattr(kv_cache_manager.KVCacheManager, "free", free_head_first)
    r = compare_upstream("reimpl.paged_attn", "cmp_evict")
    assert r.exit_code == 1
    assert (r.first.step, r.first.field) == (4, "kv.block_tables[z]")
    assert r.first.upstream[-1] == 2 and r.first.reimpl[-1] == 1  # z took (evicted) block 1 instead of 2
    with pytest.raises(AssertionError, match=r"step 4, field kv.block_tables\[z\]"):
        assert_matches_upstream(r)


def test_cached_blocks_reused_first(compare_upstream, monkeypatch):
    """Put freed cached blocks at the front of the free queue (LIFO) instead of the back (LRU)."""

    def free_blocks_lifo(self, ordered_blocks):
        freed = []
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                freed.append(b)
        self.free_queue.prepend_n(freed)

    monkeypatch.setattr(block_pool.BlockPool, "free_blocks", free_blocks_lifo)
    r = compare_upstream("reimpl.paged_attn", "cmp_evict")
    assert r.exit_code == 1
    assert r.first.step == 4 and r.first.field.startswith("kv.")


def test_chunk_one_token_short(compare_upstream, monkeypatch):
    def chunk_short(self, num_wanted, token_budget):
        return min(num_wanted, token_budget) - 1 if num_wanted > token_budget else num_wanted

    monkeypatch.setattr(chunked_prefill.Scheduler, "chunk", chunk_short)
    r = compare_upstream("reimpl.chunked_prefill", "cmp_chunked")
    assert r.exit_code == 1
    assert r.first.step == 1
    assert r.first.field == "scheduler.scheduled[long1].num_scheduled_tokens"
    assert (r.first.upstream, r.first.reimpl) == (40, 39)  # budget 48 - 8 for 'short' = 40


def test_off_by_one_slot_mapping(compare_upstream, monkeypatch):
    orig = paged_attn.slot_mapping
    monkeypatch.setattr(paged_attn, "slot_mapping", lambda table, pos, bs: [s + 1 for s in orig(table, pos, bs)])
    r = compare_upstream("reimpl.paged_attn", "cmp_single")
    assert r.exit_code == 1
    assert (r.first.step, r.first.field) == (1, "runner.requests[r0].slot_mapping")
    assert r.first.reimpl[0] == r.first.upstream[0] + 1
    assert any(not t.ok for t in r.tensors if t.name.startswith("kv_blocks"))  # and the cache contents moved


def test_preempt_the_wrong_request(compare_upstream, upstream_run, monkeypatch):
    """Preempt the oldest running request instead of the newest."""
    monkeypatch.setattr(chunked_prefill.Scheduler, "pick_victim", lambda self: self.running.pop(0))
    r = compare_upstream("reimpl.chunked_prefill", "cmp_preempt")
    assert r.exit_code == 1
    steps = upstream_run("cmp_preempt").steps
    first_preemption = min(s for s, st in steps.items() if st["scheduler"]["preempted"])
    assert r.first.step == first_preemption
    assert r.first.field.startswith("scheduler.")


def test_cli_names_first_divergence_and_explains(monkeypatch, upstream_run):
    upstream_run("cmp_chunked")
    monkeypatch.setattr(chunked_prefill.Scheduler, "chunk",
                        lambda self, w, b: min(w, b) - 1 if w > b else w)
    r = CliRunner().invoke(app, ["compare", "reimpl.chunked_prefill", "--scenario",
                                 "traces/scenarios/cmp_chunked.toml", "--explain"], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    assert "first divergence: step 1 · scheduler.scheduled[long1].num_scheduled_tokens" in r.output
    assert "explain: state at step 1" in r.output
    assert "admission stopped by" in r.output  # the reimpl's queues and budget at that step


def test_headline_is_the_first_wrong_tensor_in_data_flow(compare_upstream, cli, tmp_path, upstream_run):
    """Attention outputs scaled by -3 in every layer: at step 1 layer 0's attention output, layer 1's KV blocks and
    attention output and the sampled token all differ. The headline is the cause, layer 0's attention output,
    not the sampled token (issue 30); the rest follow in the model's order."""
    def negated(q, k_new, v_new, cache, meta, bf16_weights=False):
        return paged_attn.paged_attention(q, k_new, v_new, cache, meta, bf16_weights=bf16_weights) * -3.0

    r = compare_upstream("reimpl.paged_attn", "cmp_single", impl={"paged_attention": negated})
    assert r.exit_code == 1
    at_step_1 = [d.field for d in r.ordered() if d.step == 1]
    assert at_step_1 == ["attn_out.layers.0", "kv_blocks.layers.1", "attn_out.layers.1", "runner.sampled_token_ids[r0]"]
    assert (r.first.kind, r.first.step, r.first.field) == ("tensor", 1, "attn_out.layers.0")
    assert r.first.message.startswith("tensor attn_out.layers.0 out of tolerance at step 1: max |Δ|")
    assert r.to_json()["first_divergence"]["field"] == "attn_out.layers.0"
    with pytest.raises(AssertionError, match=r"tensor attn_out.layers.0 at step 1 out of tolerance"):
        assert_matches_upstream(r)


def test_data_flow_order_of_names():
    """flow.flow_key on the names compare produces: decisions before the model, the model layer by layer and op by
    op (TP collectives, MoE routing), the logits, then the sampler; ranks in order; steps first."""
    from vllm_tour.compare.diffs import Divergence
    from vllm_tour.compare.flow import flow_key

    want = ["step", "scheduler.scheduled[a].num_scheduled_tokens", "kv.block_tables[a]", "runner.requests[a].slot_mapping",
            "attention.requests[a].seq_len", "rank0/tp.all_reduce_in.model.embed_tokens",
            "rank1/tp.column_out.model.layers.0.self_attn.qkv_proj", "kv_blocks.layers.0", "attn_out.layers.0",
            "rank0/tp.all_reduce_in.model.layers.0.self_attn.o_proj", "rank1/tp.all_reduce_in.model.layers.0.self_attn.o_proj",
            "rank0/tp.all_reduce_out.model.layers.0.self_attn.o_proj", "router_logits.layers.0",
            "moe.layers[0].topk_ids[3]", "rank0/tp.all_reduce_in.model.layers.0.mlp.experts", "moe_partial.layers.0.rank1",
            "moe_out.layers.0", "rank1/tp.all_reduce_out.model.layers.0.mlp.experts",
            "moe.layers[1].rank[0].expert_map", "rank1/final_hidden", "rank1/tp.all_gather_in.logits",
            "rank0/tp.all_gather_out.logits", "runner.sampled_token_ids[a]", "reimpl.exception"]
    kinds = {"step": "missing", "reimpl.exception": "crash"}
    divs = [Divergence(kinds.get(f, "tensor" if "layers" in f or "/" in f else "decision"), 2, f) for f in want]
    divs += [Divergence("decision", 1, "runner.sampled_token_ids[a]"), Divergence("tokens", None, "outputs[a].token_ids[0]")]
    got = sorted(reversed(divs), key=flow_key)
    assert [(d.step, d.field) for d in got] == ([(1, "runner.sampled_token_ids[a]")] + [(2, f) for f in want]
                                                + [(None, "outputs[a].token_ids[0]")])
