"""Nothing lost at 80 columns (issue 29 item 5): source folds long code lines, probes keep dotted names whole."""

import subprocess
import sys

from vllm_tour.paths import REPO_ROOT

QUAL = "vllm.v1.core.sched.scheduler.Scheduler._preempt_request"


def test_source_folds_code_at_80_columns_and_cuts_nothing(cli):
    out = cli("source", QUAL, columns=80)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in out.stdout
    # the signature line is longer than 80 columns: its end comes back on the next line, right of the gutter
    joined = " ".join(line.split("│", 1)[-1].strip() for line in lines)
    assert "drop_stale_output: bool = False" in " ".join(joined.split())


def test_probes_at_80_columns_keep_each_target_whole(cli):
    out = cli("probes", columns=80)
    assert out.returncode == 0, out.stderr
    assert "vllm.v1.core.sched.scheduler.Scheduler.schedule" in out.stdout  # one line, not folded mid-name
    assert "vllm.v1.core.sched.scheduler.Scheduler._preempt_request" in out.stdout
    assert max(map(len, out.stdout.splitlines())) <= 80


def test_the_trace_summary_counts_from_the_process_start():
    """What the user waited (imports and model set-up included), not only the engine run's share."""
    code = ("import time; time.sleep(1.5); from vllm_tour.engine.trace_command import _since_process_start; "
            "print(_since_process_start())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert 1.5 <= float(out.stdout) < 60
