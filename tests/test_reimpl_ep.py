"""reimpl/moe.py and reimpl/ep.py on their own: placement equals upstream's determine_expert_map, the routing
equals upstream's CPU router, and both expert-parallel flows give the one-device MoE block's numbers."""

import pytest
import torch

from reimpl import ep
from reimpl.moe import Expert, moe_block, route


def _block(num_experts=6, hidden=32, inter=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = [Expert(torch.randn(inter, hidden, generator=g) / 4, torch.randn(inter, hidden, generator=g) / 4,
                      torch.randn(hidden, inter, generator=g) / 4) for _ in range(num_experts)]
    return torch.randn(num_experts, hidden, generator=g), experts, torch.randn(11, hidden, generator=g)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_placement_is_upstreams(placement):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for num_experts in (4, 5, 8, 9):
        for ep_size in (1, 2, 3, 4):
            for rank in range(ep_size):
                local, emap, _ = determine_expert_map(ep_size, rank, num_experts, placement)
                assert ep.determine_expert_map(ep_size, rank, num_experts, placement) == (
                    local, None if emap is None else emap.tolist()), (num_experts, ep_size, rank)
    assert ep.determine_expert_map(2, 0, 4)[1] == [0, 1, -1, -1] and ep.determine_expert_map(2, 1, 4)[1] == [-1, -1, 0, 1]


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_is_upstreams_cpu_router(renormalize):
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    gate, _, h = _block()
    r = route(h, gate, 2, renormalize)
    w, ids = _softmax_topk(h @ gate.T, 2, renormalize)
    order = ids.long().sort(dim=-1)
    mine = r.ids.sort(dim=-1)
    assert torch.equal(order.values, mine.values)
    torch.testing.assert_close(w.gather(1, order.indices), r.weights.gather(1, mine.indices), atol=1e-6, rtol=1e-6)
    sums = r.weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == renormalize


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_size", [1, 2, 3])
def test_local_experts_then_all_reduce_equals_one_device(ep_size, placement):
    gate, experts, h = _block()
    one = moe_block(h, gate, experts, 2, True)
    par = ep.expert_parallel_moe(h, gate, experts, 2, True, ep_size, placement)
    torch.testing.assert_close(par.out, one.out, atol=1e-5, rtol=1e-5)
    assert len(par.ranks) == ep_size
    # each (token, expert) pair is computed on exactly one rank
    assert sum(sum(p.local_tokens_per_expert) for p in par.ranks) == h.shape[0] * 2
    if ep_size > 1:
        assert all(not torch.equal(p.partial, par.out) for p in par.ranks)  # no rank alone has the answer


@pytest.mark.parametrize("shards", [(11,), (5, 6), (3, 0, 8)])
def test_dispatch_combine_equals_one_device_per_shard(shards):
    gate, experts, h = _block()
    parts = list(torch.split(h, list(shards)))
    outs = ep.dispatch_combine_moe(parts, gate, experts, 2, True)
    for part, out in zip(parts, outs):
        if len(part):
            torch.testing.assert_close(out, moe_block(part, gate, experts, 2, True).out, atol=1e-5, rtol=1e-5)


def test_a_wrong_map_breaks_the_sum():
    """The check above can fail: a rank that skips one of its experts loses that expert's share."""
    gate, experts, h = _block()
    one = moe_block(h, gate, experts, 2, True)
    _, emap = ep.determine_expert_map(2, 0, len(experts))
    mine = ep.local_experts(experts, emap)
    emap[0] = -1  # rank 0 still holds expert 0's weights, but its map says another rank does
    from reimpl.moe import run_experts
    partial0, _ = run_experts(h, route(h, gate, 2, True), mine, emap)
    _, emap1 = ep.determine_expert_map(2, 1, len(experts))
    partial1, _ = run_experts(h, route(h, gate, 2, True), ep.local_experts(experts, emap1), emap1)
    assert not torch.allclose(ep.all_reduce([partial0, partial1]), one.out, atol=1e-3)
