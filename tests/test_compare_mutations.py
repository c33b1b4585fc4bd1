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
