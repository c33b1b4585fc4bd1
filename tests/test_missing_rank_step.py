"""A TP run whose rank 1 ended before flushing its last step (issue 29 item 4): the reader says which steps
that rank lacks, `show` does not claim every rank agreed there, and the Perfetto export still works."""

import json
import shutil

from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.trace.reader import load_run
from vllm_tour.views.perfetto import RANK_PID, to_chrome_trace


def _without_rank1_last_step(tmp_path):
    src = GOLDEN_DIR / "v0.21.0" / "tp_single"  # a real TP=2 run with collectives recorded on both ranks
    run = tmp_path / "tp_single"
    shutil.copytree(src, run)
    f = run / "records.0.jsonl"
    lines = [json.loads(line) for line in f.read_text().splitlines()]
    last = max(r["step"] for r in lines)
    kept = [r for r in lines if not (r["step"] == last and r.get("proc", {}).get("rank") == 1)]
    assert len(kept) < len(lines)
    f.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return run, last


def test_the_missing_rank_step_is_named_and_export_works(tmp_path, cli):
    run_dir, last = _without_rank1_last_step(tmp_path)
    run = load_run(run_dir)
    assert any(f"rank 1 has no runner record for step(s) {last}" in w for w in run.warnings)
    assert 1 not in run.step(last).runner and 0 in run.step(last).runner
    trace = to_chrome_trace(run)  # was KeyError: 1
    ranks_at_last = {e["pid"] - RANK_PID for e in trace["traceEvents"]
                     if e.get("ph") == "X" and e.get("args", {}).get("step") == last and e["pid"] >= RANK_PID}
    assert ranks_at_last == {0}  # rank 0's collectives of that step, none invented for rank 1
    out = cli("show", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert f"rank 1 has no runner record for step(s) {last}" in out.stdout
    out = cli("export", str(run_dir), "--format", "perfetto", "--out", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_complete_tp_run_has_no_such_warning():
    run = load_run(GOLDEN_DIR / "v0.21.0" / "tp_single")
    assert not [w for w in run.warnings if "has no runner record" in w]
