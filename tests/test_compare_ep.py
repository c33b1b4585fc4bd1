"""compare reimpl.ep against upstream tiny-qwen3-moe at TP=1 on CPU: routing ids exact, weights, router logits
and MoE outputs within fp32 tolerance, decisions and tokens exact, expert placement per simulated rank as
upstream's determine_expert_map gives it; and broken on purpose, exit 1 naming step, layer and field."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reimpl import ep
from vllm_tour.cli import app
from vllm_tour.compare.modules import MODULES
from vllm_tour.compare.pytest_plugin import assert_matches_upstream

ROOT = Path(__file__).resolve().parents[1]
MOE = ["cmp_moe_single", "cmp_moe_batch", "cmp_moe_chunked"]


@pytest.mark.parametrize("name", MOE)
def test_reimpl_ep_matches_upstream(compare_upstream, upstream_run, name):
    r = compare_upstream("reimpl.ep", name)
    assert_matches_upstream(r)
    assert r.steps_upstream == r.steps_reimpl > 0
    assert {"router_logits.layers.0", "moe_out.layers.0", "router_logits.layers.1", "moe_out.layers.1"} <= {t.name for t in r.tensors}
    assert max(t.max_abs for t in r.tensors) <= 1e-4
    # upstream's MoE probe recorded every layer at every step that ran the model: the routing compared is real
    up = upstream_run(name)
    for step, s in up.steps.items():
        if not s.get("runner"):
            continue
        layers = [m["layer"] for m in s["moe"]]
        assert layers == [0, 1], (step, layers)
        for m in s["moe"]:
            assert m["expert_map"] is None and m["num_local_experts"] == m["num_experts"] == 4  # TP=1: no EP
            assert m["kernel"].startswith("CPUUnquantizedExperts")
            assert sum(m["tokens_per_expert"]) == 2 * m["num_tokens"] == 2 * s["runner"]["num_tokens"]


def test_scenarios_route_to_every_expert(upstream_run):
    """Else a wrong expert's weights or a lost expert could go unseen."""
    for name in MOE:
        used = {e for s in upstream_run(name).steps.values() for m in s["moe"]
                for e, n in enumerate(m["tokens_per_expert"]) if n}
        assert used == {0, 1, 2, 3}, name


@pytest.mark.parametrize("module", [m for m, spec in MODULES.items() if not spec.triton and not spec.moe_only and spec.world_size == 1])
def test_other_modules_accept_the_moe_model(compare_upstream, module):
    assert_matches_upstream(compare_upstream(module, "cmp_moe_batch"))


def test_no_topk_renormalisation_names_the_weights(compare_upstream, monkeypatch):
    route = ep.route
    monkeypatch.setattr(ep, "route", lambda h, gate, top_k, renormalize: route(h, gate, top_k, False))
    r = compare_upstream("reimpl.ep", "cmp_moe_single")
    assert r.exit_code == 1
    assert r.first.step == 1 and r.first.field.startswith("moe.layers[0].topk_weights[")
    assert abs(sum(r.first.upstream) - 1) < 1e-5 and sum(r.first.reimpl) < 1 - 1e-3  # upstream's sum to 1
    assert "moe_out.layers.0" in {t.name for t in r.bad_tensors}


def test_headline_is_layer_0_moe_output_not_layer_1_routing(compare_upstream):
    """The MoE output of every layer scaled by 3, its routing right: at step 1 layer 0's MoE output, layer 1's
    router logits and routing, its output and the sampled token all differ. The headline is the cause, layer 0's
    MoE output; the layer-1 routing change and the token follow in the model's order (issue 30)."""
    import dataclasses

    def scaled(*a, **kw):
        out = ep.expert_parallel_moe(*a, **kw)
        return dataclasses.replace(out, out=out.out * 3.0)

    r = compare_upstream("reimpl.ep", "cmp_moe_single", impl={"moe": scaled})
    assert r.exit_code == 1
    assert (r.first.kind, r.first.step, r.first.field) == ("tensor", 1, "moe_out.layers.0")
    step1 = [d.field for d in r.ordered() if d.step == 1]
    assert step1[:3] == ["moe_out.layers.0", "router_logits.layers.1", "moe.layers[1].topk_ids[1]"]
    assert step1[-1] == "runner.sampled_token_ids[r0]"


def test_expert_map_off_by_one_names_the_rank(compare_upstream, monkeypatch):
    """Every rank's map shifted one expert along: expert 0 is computed by no rank."""
    place = ep.determine_expert_map
    monkeypatch.setattr(ep, "determine_expert_map",
                        lambda n, rank, e, placement="linear": (lambda local, m: (local, [-1] + m[:-1]))(*place(n, rank, e, placement)))
    r = compare_upstream("reimpl.ep", "cmp_moe_single")
    assert r.exit_code == 1
    assert (r.first.step, r.first.field) == (1, "moe.layers[0].rank[0].expert_map")
    assert (r.first.upstream, r.first.reimpl) == ([0, 1, -1, -1], [-1, 0, 1, -1])
    assert "moe_out.layers.0" in {t.name for t in r.bad_tensors}


def test_cli_round_robin_placement_exits_1_naming_step_layer_and_rank(upstream_run, tmp_path):
    """A learner's ep.py placing experts round-robin: same sums (each expert still runs once), other maps."""
    upstream_run("cmp_moe_single")
    text = (ROOT / "reimpl" / "ep.py").read_text()
    anchor = 'ep_size: int = 2, placement: str = "linear") -> MoEOutput:'
    assert text.count(anchor) == 1
    mine = tmp_path / "my_ep.py"
    mine.write_text(text.replace(anchor, anchor.replace('"linear"', '"round_robin"')))
    out = tmp_path / "report.json"
    res = CliRunner().invoke(app, ["compare", "reimpl.ep", "--impl", f"moe={mine}", "--scenario",
                                   "traces/scenarios/cmp_moe_single.toml", "--json", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    first = json.loads(out.read_text())["scenarios"][0]["first_divergence"]
    assert (first["step"], first["field"]) == (1, "moe.layers[0].rank[0].expert_map")
    assert (first["upstream"], first["reimpl"]) == ([0, 1, -1, -1], [0, -1, 1, -1])
    assert "determine_expert_map" in first["message"]
    assert "moe.layers[0].rank[0].expert_map" in res.output


def test_cli_all_scenarios_skips_dense_ones(upstream_run, tmp_path):
    for name in MOE:
        upstream_run(name)
    out = tmp_path / "report.json"
    res = CliRunner().invoke(app, ["compare", "reimpl.ep", "--all-scenarios", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert {s["scenario"] for s in report["scenarios"]} == set(MOE)
    why = {s["scenario"]: s["why"] for s in report["skipped"]}
    assert "is dense" in why["cmp_single"] and "a repro scenario" in why["repro_ep_tp2_cpu"]
    for name in ("ep_single", "ep_batch"):  # EP=2: upstream's CPU build kills a worker; a GPU run is needed
        assert "kills a worker" in why[name] and "--upstream-run" in why[name], why[name]


def test_show_has_the_expert_view(upstream_run):
    """`show` draws tokens per expert per step and layer from the probe's records; `--step` lists them."""
    up = upstream_run("cmp_moe_batch")
    res = CliRunner().invoke(app, ["show", str(up.run_dir)], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "experts: tokens per expert per step (4 experts, 2 MoE" in res.output
    for step in (1, 2):
        counts = [" ".join(f"{n:>3}" for n in m["tokens_per_expert"]) for m in up.steps[step]["moe"]]
        assert any(line.split("│")[1:2] == [f"{step:>5} "] and all(c in line for c in counts)
                   for line in res.output.splitlines()), (step, counts)
    res = CliRunner().invoke(app, ["show", str(up.run_dir), "--step", "2"], env={"COLUMNS": "300"})
    m = up.steps[2]["moe"][1]
    assert f"MoE layer 1 (rank 0): {m['kernel']}, 4/4 experts local, expert map None; tokens per expert {m['tokens_per_expert']}" in res.output


def test_which_modules_take_which_moe_scenarios():
    from vllm_tour.compare.reimpl_side import applicable
    from vllm_tour.paths import SCENARIOS_DIR
    from vllm_tour.scenario import load_scenario

    moe_tp2 = load_scenario(SCENARIOS_DIR / "moe_tp2.toml")
    assert "is MoE" in applicable(moe_tp2, "reimpl.tp")  # its TP=2 model is the dense Qwen3
    assert applicable(moe_tp2, "reimpl.tp_moe") is None  # TP=2 without EP: every expert sharded
    assert "single-device" in applicable(moe_tp2, "reimpl.ep")
    single = load_scenario(SCENARIOS_DIR / "cmp_moe_single.toml")
    assert applicable(single, "reimpl.ep") is None and applicable(single, "reimpl.paged_attn") is None
