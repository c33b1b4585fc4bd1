"""EP=2 goldens from two H200s (upstream vLLM 0.21.0, tiny-qwen3-moe at TP=2 + enable_expert_parallel, mp executor,
one worker per GPU, fp32 with TRITON_F32_DEFAULT=ieee; ep_single+tp1: the same requests at TP=1), traced with the
MoE probes by `vllm_tour/gpu/cuda_run.sh --modules reimpl.ep` (traces/results/20261130-h200x2-v0.21.0-ep, whose
compare step judged each rank's partial output on the GPU). Upstream EP cannot run on the CPU build (its experts
kernel is handed global ids: repro_ep_tp2_cpu), so these runs are what `compare reimpl.ep` judges EP=2 against here:
each upstream rank's expert map and local token counts, its routing, decisions and tokens."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from reimpl import ep
from test_golden_v0210 import V0210, _compare_golden
from vllm_tour.cli import app
from vllm_tour.compare.moe_diff import upstream_expert_map
from vllm_tour.errors import TourError

EP_NAMES = ("ep_single", "ep_batch")


def _records(name):
    return [json.loads(line) for line in (V0210 / name / "records.0.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", EP_NAMES)
def test_cuda_ep_golden_records_every_rank_and_layer(name):
    meta = json.loads((V0210 / name / "meta.json").read_text())
    assert meta["pin"] == "v0.21.0" and meta["status"] == "ok" and meta["env"] == {"TRITON_F32_DEFAULT": "ieee"}
    assert meta["engine_args"]["tensor_parallel_size"] == 2 and meta["engine_args"]["enable_expert_parallel"]
    recs = _records(name)
    assert "probe_error" not in {r["kind"] for r in recs}
    moe = [r for r in recs if r["kind"] == "moe"]
    for step in {r["step"] for r in recs if r["kind"] == "runner"}:
        here = {(m["proc"]["rank"], m["layer"]): m for m in moe if m["step"] == step}
        assert set(here) == {(0, 0), (0, 1), (1, 0), (1, 1)}, step  # every rank, every MoE layer (not -1)
        for (rank, layer), m in here.items():
            assert m["kernel"].startswith("TritonExperts") and m["num_local_experts"] == 2
            # upstream 0.21.0 on CUDA placed the experts as the installed pin's determine_expert_map does
            assert m["expert_map"] == upstream_expert_map(2, rank, m["num_experts"])
            assert m["topk_ids"] == here[(0, layer)]["topk_ids"]  # the gate is replicated: same routing
    assert sum(f.stat().st_size for f in (V0210 / name).iterdir()) < 200 << 10


def test_cuda_ep2_tokens_equal_tp1():
    """Expert parallelism moves experts, not sums: upstream's own greedy fp32 tokens at EP=2 equal TP=1's."""
    ep2, tp1 = ([o["token_ids"] for o in json.loads((V0210 / n / "outputs.json").read_text())["requests"]]
                for n in ("ep_single", "ep_single+tp1"))
    assert ep2 == tp1 and len(ep2[0]) == 10


@pytest.mark.parametrize("name", EP_NAMES)
def test_reimpl_ep_matches_upstream_cuda_ep2(tmp_path, name):
    """Decisions and tokens exact, routing per layer exact, and each simulated rank's expert map and local token
    counts equal to what that upstream rank recorded (not to a placement function)."""
    r = _compare_golden(tmp_path, name, module="reimpl.ep")
    assert r["status"] == "clean", r["first_divergence"]
    assert r["steps"]["upstream"] == r["steps"]["reimpl"] > 1


def test_round_robin_placement_diverges_from_upstream_ep2_ranks(tmp_path, monkeypatch):
    place = ep.determine_expert_map
    monkeypatch.setattr(ep, "determine_expert_map", lambda n, rank, e, placement="linear": place(n, rank, e, "round_robin"))
    r = _compare_golden(tmp_path, "ep_batch", module="reimpl.ep")
    first = r["first_divergence"]
    assert r["status"] == "diverged" and (first["step"], first["field"]) == (1, "moe.layers[0].rank[0].expert_map")
    assert (first["upstream"], first["reimpl"]) == ([0, 1, -1, -1], [0, -1, 1, -1])
    assert "upstream's recorded value" in first["message"]


def test_cli_compares_against_the_golden_in_place(tmp_path):
    """The command a user runs on CPU: --upstream-run a GPU run; the golden is read, never written."""
    before = sorted(p.name for p in (V0210 / "ep_single").iterdir())
    out = tmp_path / "report.json"
    res = CliRunner().invoke(app, ["compare", "reimpl.ep", "--scenario", "traces/scenarios/ep_single.toml",
                                   "--upstream-run", str(V0210 / "ep_single"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["scenarios"][0]["status"] == "clean"
    assert sorted(p.name for p in (V0210 / "ep_single").iterdir()) == before


def test_cli_upstream_run_of_another_scenario_is_refused(tmp_path):
    shutil.copytree(V0210 / "ep_single+tp1", tmp_path / "run")
    res = CliRunner().invoke(app, ["compare", "reimpl.ep", "--scenario", "traces/scenarios/ep_single.toml",
                                   "--upstream-run", str(tmp_path / "run")])
    assert isinstance(res.exception, TourError) and res.exception.exit_code == 2  # main() prints it as one line
    assert "is not a run of scenario ep_single: its tensor_parallel_size differs (1 vs 2)" in str(res.exception)
    res = CliRunner().invoke(app, ["compare", "reimpl.ep", "--all-scenarios", "--upstream-run", str(tmp_path / "run")])
    assert isinstance(res.exception, TourError) and "give it with --scenario FILE" in str(res.exception)
