"""Upstream's own output during a run (vLLM's log lines, every process's stderr) lands in the run's upstream.log,
not on the terminal, which gets one line about it; --verbose shows it live instead. Real `trace` runs, as a user
starts them (the EP repro's crash, a worker's backtrace, is tests/test_repro.py's)."""

import re

INFO = re.compile(r"\bINFO \d\d-\d\d ")  # a vLLM log line at INFO: every engine start logs some


def test_trace_keeps_upstream_logs_in_the_run_and_says_so_in_one_line(tmp_path, cli):
    run = tmp_path / "run"
    r = cli("trace", "-r", "hello", "--max-tokens", "1", "--out", run, env={"VLLM_LOGGING_LEVEL": "INFO"})
    assert r.returncode == 0, r.stderr[-3000:]
    log = (run / "upstream.log").read_text()
    assert len(INFO.findall(log)) > 3
    assert not INFO.search(r.stdout + r.stderr), (r.stdout + r.stderr)[-3000:]
    assert r.stderr == "", r.stderr[-3000:]
    # at INFO, vLLM also warns of the tour's own VLLM_TOUR_* variables: one line says so, and where the log is
    warned = len(re.findall(r"\bWARNING \d\d-\d\d ", log))
    assert warned > 0
    logged = [line.strip() for line in r.stdout.splitlines() if "upstream logged" in line]
    assert len(logged) == 1 and re.fullmatch(rf"upstream logged 0 errors, \d+ warnings?: see {re.escape(str(run))}/upstream.log",
                                             logged[0]), r.stdout
    assert int(logged[0].split(", ")[1].split(" ")[0]) >= warned


def test_verbose_shows_upstream_live_and_keeps_no_log(tmp_path, cli):
    run = tmp_path / "run"
    r = cli("trace", "-r", "hello", "--max-tokens", "1", "--out", run, "--verbose", env={"VLLM_LOGGING_LEVEL": "INFO"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert INFO.search(r.stdout), r.stdout[-3000:]
    assert not (run / "upstream.log").exists() and "upstream logged" not in r.stdout


def test_a_run_that_went_as_expected_gets_no_line(tmp_path):
    """Only errors and warnings are worth a line: a log holding vLLM's import notice (logged without a level
    prefix) and INFO lines is left unmentioned, unless the run failed."""
    from vllm_tour.engine.upstream_log import summary_line

    (tmp_path / "upstream.log").write_text(
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
        "(MainProcess pid=1) INFO 12-02 00:55:33 [core.py:100] Initializing a V1 LLM engine\n")
    assert summary_line(tmp_path, failed=False) is None
    assert summary_line(tmp_path, failed=True) == f"upstream logged 0 errors, 0 warnings: see {tmp_path}/upstream.log"
    assert summary_line(tmp_path / "no-such-run", failed=True) is None
    (tmp_path / "upstream.log").write_text("")  # a scheduler-only run that failed in Python: nothing to point at
    assert summary_line(tmp_path, failed=True) is None
