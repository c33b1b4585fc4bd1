"""`vllm_tour.load_run` and the step table as rows: the read API README documents for notebooks."""

import json
import re
import subprocess
import sys
from pathlib import Path

import vllm_tour
from vllm_tour.paths import REPO_ROOT


def test_step_rows_agree_with_the_records_of_a_golden_run():
    run = vllm_tour.load_run("preemption")
    rows = run.step_rows()
    assert [r["step"] for r in rows] == [s.index for s in run.steps]
    for row, step in zip(rows, run.steps):
        assert row["scheduled"] == [r.req_id for r in step.scheduler.scheduled]
        assert row["tokens_scheduled"] == sum(r.num_scheduled_tokens for r in step.scheduler.scheduled)
        assert row["free_blocks"] == step.kv.free_blocks
    # the scenario is built to preempt: the rows show it where the scheduler record does
    assert [r["step"] for r in rows if r["preempted"]] == [s.index for s in run.steps if s.scheduler.preempted]
    assert any(r["preempted"] for r in rows)
    json.dumps(rows)  # plain data: a notebook can serialise or frame it


def test_request_rows_carry_each_requests_block_table():
    run = vllm_tour.load_run("preemption")
    rows = run.request_rows()
    assert len(rows) == sum(len(s.scheduler.scheduled) for s in run.steps)
    first = rows[0]
    assert first["block_table"] == run.steps[0].kv.block_tables[first["req_id"]]
    first["block_table"].append(-1)  # a copy: the run is untouched
    assert run.steps[0].kv.block_tables[first["req_id"]][-1] != -1


def test_readmes_example_runs_as_written():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("### Read a run from Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(REPO_ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "preemptions: [(38, ['r2'])]" in out.stdout
