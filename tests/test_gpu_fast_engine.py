"""The mini engine's performance path (reimpl/fast_engine.py) makes the mini engine's decisions.

CPU, fp32, the torch reference attention in place of the Triton kernel: the
same scenarios through `reimpl.engine.Engine` and `reimpl.fast_engine.FastEngine`
must schedule the same tokens, hand out the same blocks and produce the same
greedy tokens. (On the H200 the race runs the same engine in bf16 with the
Triton kernel and CUDA graphs: vllm_tour/bench/race_gpu.py.)
"""

from __future__ import annotations

import pytest
import torch

from reimpl.config import EngineConfig, RequestIn
from reimpl.engine import Engine
from reimpl.fast_engine import FastEngine, FastQwen3
from vllm_tour.upstream.models import resolve_model
from vllm_tour.paths import SCENARIOS_DIR
from vllm_tour.scenario import load_scenario

SCENARIOS = ["cmp_chunked", "cmp_preempt", "cmp_shared_prefix", "cmp_arrivals"]


def _both(name: str):
    sc = load_scenario(SCENARIOS_DIR / f"{name}.toml")
    e = sc.engine
    model_dir = str(resolve_model(sc.model))
    num_blocks = (e.num_blocks or 64) + 1
    budget = e.max_num_batched_tokens or 2048
    seqs = e.max_num_seqs or 256
    cfg = EngineConfig(model_dir, e.block_size, num_blocks, budget, seqs, e.max_model_len, e.enable_prefix_caching,
                       cuda_graphs=False)
    reqs = [RequestIn(r.req_id, list(r.prompt_token_ids), r.max_tokens, 0.0, None, r.arrival_step, None) for r in sc.requests]
    ref = Engine(cfg)
    ref_steps = [[(s.req_id, s.kind, s.num_tokens, s.num_computed_tokens) for s in res.out.scheduled]
                 + [("blocks", dict(res.out.new_block_ids)), ("preempted", [p.req_id for p in res.out.preempted])]
                 for res in ref.run(reqs)]
    fast = FastEngine(FastQwen3.from_dir(model_dir, device="cpu", dtype=torch.float32), cfg)
    fast_steps = []
    outs = fast.generate(reqs,
                         on_step=lambda out, sampled: fast_steps.append(
                             [(s.req_id, s.kind, s.num_tokens, s.num_computed_tokens) for s in out.scheduled]
                             + [("blocks", dict(out.new_block_ids)), ("preempted", [p.req_id for p in out.preempted])]))
    return ref, ref_steps, fast, fast_steps, outs


@pytest.mark.parametrize("name", SCENARIOS)
def test_fast_engine_same_decisions_and_tokens(name):
    ref, ref_steps, fast, fast_steps, outs = _both(name)
    assert fast_steps == ref_steps
    assert outs == ref.outputs()
    assert all(len(v) > 0 for v in outs.values())


def test_fast_engine_notices_a_broken_slot_mapping(monkeypatch):
    """The comparison can fail: writing K/V one slot off changes the tokens."""
    import reimpl.fast_engine as fe

    orig = fe.FastEngine.prepare

    def shifted(self, out):
        x = orig(self, out)
        x.slots = x.slots + 1  # the slot mapping, one off
        return x

    monkeypatch.setattr(fe.FastEngine, "prepare", shifted)
    ref, _, _, _, outs = _both("cmp_chunked")
    assert outs != ref.outputs()


def _tiny_engine():
    cfg = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
           "hidden_size": 16, "intermediate_size": 32, "vocab_size": 50, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 64, "tie_word_embeddings": True}
    return FastEngine(FastQwen3.random(cfg, device="cpu", dtype=torch.float32),
                      EngineConfig(block_size=4, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                                   max_model_len=32, enable_prefix_caching=False, cuda_graphs=False))


def test_prepare_orders_rows_longest_first():
    """The step's rows go longest sequence first (the attention kernel starts its programs in row order), each
    row still sampling for its own request; the scheduler's order is left as it was."""
    from reimpl.request import Request

    eng = _tiny_engine()
    eng.scheduler.add_request(Request("short", [1, 2], 3))
    eng.scheduler.add_request(Request("long", [3, 4, 5, 6, 7], 3))
    out = eng.scheduler.schedule()
    x = eng.prepare(out)
    assert [s.req_id for s in out.scheduled] == ["short", "long"]
    assert x.seq_lens.tolist() == [5, 2] and x.sample_rids == ["long", "short"] and x.sample_idx == [4, 6]
    assert x.ids.tolist() == [3, 4, 5, 6, 7, 1, 2]


def test_prepare_positions_and_slots():
    """Positions restart per request; slots follow the block table (block * block_size + offset)."""
    eng = _tiny_engine()
    from reimpl.request import Request

    eng.scheduler.add_request(Request("a", [1, 2, 3, 4, 5, 6], 3))
    eng.scheduler.add_request(Request("b", [7, 8, 9], 3))
    out = eng.scheduler.schedule()
    x = eng.prepare(out)
    assert x.ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert x.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    ta, tb = eng.kv.block_ids("a"), eng.kv.block_ids("b")
    assert x.slots.tolist() == [ta[p // 4] * 4 + p % 4 for p in range(6)] + [tb[0] * 4 + p for p in range(3)]
    assert x.cu.tolist() == [0, 6, 9] and x.seq_lens.tolist() == [6, 3] and x.max_q == 6
    assert x.sample_idx == [5, 8] and x.sample_rids == ["a", "b"] and x.prev_dst.size == 0


def test_upload_starts_every_part_on_16_bytes():
    """Parts of odd sizes packed into one upload still start 16-byte aligned (Triton compiles a variant per
    pointer alignment: a part's alignment must not follow the sizes before it) and hold their values."""
    import numpy as np

    eng = _tiny_engine()
    arrays = {"a": np.arange(3, dtype=np.int64), "b": np.arange(5, dtype=np.int64) + 10,
              "c": np.arange(7, dtype=np.int32), "d": np.arange(6, dtype=np.int32).reshape(2, 3),
              "e": np.ones(1, np.float32)}
    d = eng._upload(**arrays)
    for k, a in arrays.items():
        assert d[k].data_ptr() % 16 == 0, k
        assert d[k].shape == a.shape and d[k].numpy().tolist() == a.tolist(), k


def test_per_step_kernel_arguments_are_not_specialized():
    """Integer arguments that change from step to step are left out of Triton's specialization (divisible by
    16, equal to 1): otherwise a new value would stop the run to compile a kernel variant."""
    from reimpl import fused_ops, triton_attn

    for kernel, names in ((fused_ops._sample_kernel, {"seed"}), (triton_attn.paged_attention_kernel, {"num_seqs", "stride_bt"})):
        params = [p.name for p in kernel.params]
        unspecialized = {params[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
        assert names <= unspecialized, (kernel.fn.__name__, unspecialized)
