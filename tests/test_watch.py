"""`vllm-tour watch`: a live view of a run being written, that ends by itself when the run does."""

import os
import subprocess
import sys
import time

from vllm_tour.paths import REPO_ROOT
from vllm_tour.trace.reader import load_run
from vllm_tour.views.watch import recent_events, step_rate


def test_watch_follows_a_live_trace_and_ends_with_it(tmp_path):
    out = tmp_path / "live"
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "VLLM_TOUR_RUNS": str(tmp_path / "runs")}
    trace = subprocess.Popen([sys.executable, "-m", "vllm_tour", "trace", "-r", "one", "-r", "two", "-r", "three",
                              "--num-blocks", "7", "--max-tokens", "100", "--ignore-eos", "--out", str(out)],
                             cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while not (out / "meta.json").is_file() and time.time() < deadline:  # watch needs the run to exist
            time.sleep(0.2)
        watch = subprocess.run([sys.executable, "-m", "vllm_tour", "watch", str(out)], cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
        assert trace.wait(timeout=60) == 0
    finally:
        if trace.poll() is None:
            trace.kill()
    assert watch.returncode == 0, watch.stderr
    run = load_run(out)
    assert run.meta.status == "ok"
    # it was watching while the run went on (the last frame is the finished run) and stopped by itself
    assert watch.stdout.rstrip().endswith(f"live: ok, {len(run.steps)} steps")
    assert "steps/s" in watch.stdout and "blocks in use" in watch.stdout and "preempted" in watch.stdout


def test_a_finished_run_is_drawn_once_with_its_rate_and_events(cli):
    out = cli("watch", "preemption")
    assert out.returncode == 0, out.stderr
    run = load_run("preemption")
    assert out.stdout.rstrip().endswith(f"preemption: ok, {len(run.steps)} steps")
    assert step_rate(run) is None and "rate: no step times" in out.stdout  # goldens zero their times
    assert "step 38: preempted r2" in out.stdout and recent_events(run)[-1] == "step 61: r2 hit 32 cached tokens"
    assert "step 61: r2 hit 32 cached tokens" in out.stdout


def test_bad_interval_is_one_line(cli):
    out = cli("watch", "preemption", "--interval", "2")
    assert out.returncode == 2 and "--interval 2.0: give a number of seconds above 0 and at most 0.5" in out.stderr
