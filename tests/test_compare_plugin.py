"""The pytest fixtures users get (vllm_tour.compare.pytest_plugin): their own component vs upstream."""

import pytest

from reimpl import block_pool
from vllm_tour.compare.pytest_plugin import assert_matches_upstream


class ListFreeQueue:
    """A learner's own free queue: a plain list (O(n) remove), same order rules."""

    def __init__(self, blocks):
        self.q = list(blocks)

    def __len__(self):
        return len(self.q)

    def popleft_n(self, n):
        out, self.q = self.q[:n], self.q[n:]
        return out

    def remove(self, block):
        self.q.remove(block)

    def append_n(self, blocks):
        self.q.extend(blocks)

    def prepend_n(self, blocks):
        self.q[:0] = blocks

    def block_ids(self):
        return [b.block_id for b in self.q]


def test_my_free_queue_matches_upstream(compare_upstream, monkeypatch):
    monkeypatch.setattr(block_pool, "FreeBlockQueue", ListFreeQueue)
    for scenario in ("cmp_evict", "cmp_shared_prefix"):
        assert_matches_upstream(compare_upstream("reimpl.paged_attn", scenario))


def test_my_broken_free_queue_is_caught(compare_upstream, monkeypatch):
    class Fifo(ListFreeQueue):
        def prepend_n(self, blocks):  # forgets that uncached blocks are reused first
            self.q.extend(blocks)

    monkeypatch.setattr(block_pool, "FreeBlockQueue", Fifo)
    with pytest.raises(AssertionError, match=r"at step \d+, field kv\."):
        assert_matches_upstream(compare_upstream("reimpl.paged_attn", "cmp_evict"))


def test_upstream_run_fixture_gives_records_and_tensors(upstream_run):
    run = upstream_run("cmp_shared_prefix")
    assert run.meta["status"] == "ok" and run.outputs
    hits = [h for s in run.steps.values() for h in s["kv"]["prefix_hits"]]
    assert hits and all(h["num_hit_tokens"] % 32 == 0 for h in hits)
    t = run.capture("attn_out.layers.0", 1)
    assert t.shape[1] == 256  # 4 heads x 64
    assert upstream_run("cmp_shared_prefix") is run  # once per session
