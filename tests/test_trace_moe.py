"""The MoE probes on a tensor-parallel run (tiny-qwen3-moe, TP=2, no EP): every rank records every layer's
routing, and each rank's partial output, captured before the in-place all-reduce, sums to the MoE output."""

from safetensors.torch import load_file

from vllm_tour.trace.reader import load_run


def test_tp2_moe_partials_sum_to_the_output(trace_runs):
    path = trace_runs.get("moe_tp2", capture=["moe_partial", "moe_out"])
    run = load_run(path)
    assert run.finished and run.steps
    for s in run.steps:
        assert sorted(s.moe) == [0, 1]
        for rank, records in s.moe.items():
            assert [r.layer for r in records] == [0, 1]
            # TP without EP: every expert is on every rank (a slice of each), no expert map
            assert all(r.expert_map is None and r.num_local_experts == 4 for r in records)
        assert [r.topk_ids for r in s.moe[0]] == [r.topk_ids for r in s.moe[1]]  # same tokens, same gate
        ranks = [load_file(str(path / f"captures/step-{s.index:04d}.rank{r}.safetensors")) for r in (0, 1)]
        for layer in (0, 1):
            partial = [t[f"moe_partial.layers.{layer}"] for t in ranks]
            out = ranks[0][f"moe_out.layers.{layer}"]
            assert (partial[0] + partial[1] - out).abs().max() <= 1e-5
            assert (partial[0] - out).abs().max() > 1e-2  # a partial alone is not the output
            assert (ranks[1][f"moe_out.layers.{layer}"] - out).abs().max() == 0  # both ranks end with the sum
