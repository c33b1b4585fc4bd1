"""The spool (vllm_tour/trace/spool.py): a helper process builds the worker's records and writes every record.

A traced run's records are the same with and without the helper; whatever a traced process handed over
reaches the file when that process is killed, when its helper is killed, and when the ring wraps or is full;
a record the helper cannot build is written as the probe's error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from vllm_tour.trace import spool
from vllm_tour.trace.writer import RECORDER, Recorder


def _lines(run_dir) -> list[dict]:
    return [json.loads(line) for f in sorted(run_dir.glob("records.*.jsonl")) for line in f.read_text().splitlines()]


def _comparable(rec: dict) -> dict:
    rec = {k: v for k, v in rec.items() if k not in ("time", "duration_s")}
    rec["proc"] = {k: v for k, v in rec["proc"].items() if k != "pid"}
    return rec


def test_a_traced_run_writes_the_same_records_with_and_without_the_helper(tmp_path, monkeypatch):
    from vllm_tour.paths import SCENARIOS_DIR
    from vllm_tour.scenario import load_scenario
    from vllm_tour.upstream_run import run_upstream

    scenario = load_scenario(SCENARIOS_DIR / "preemption.toml")  # preemptions, resumed requests, growing tables
    before = RECORDER.helper_cpu_s
    spooled = run_upstream(scenario, tmp_path / "spool")
    after = RECORDER.helper_cpu_s
    assert after > before  # a helper ran, and exited when the run closed (its CPU time is read then)
    monkeypatch.setenv(spool.SPOOL_ENV, "0")
    inline = run_upstream(scenario, tmp_path / "inline")
    assert RECORDER.helper_cpu_s == after  # no helper this time
    a, b = _lines(spooled), _lines(inline)
    kinds = {r["kind"] for r in a}
    assert {"scheduler", "kv", "runner", "attention"} <= kinds
    assert any(r["kind"] == "attention" and r.get("block_table_since") is not None for r in a)  # deltas went through
    assert [list(r) for r in a] == [list(r) for r in b]  # same records, same fields in the same order
    assert list(map(_comparable, a)) == list(map(_comparable, b))


def _record(i: int, size: int = 40) -> dict:
    return {"step": i, "proc": {"role": "engine_core", "pid": 1, "rank": 0}, "kind": "test", "payload": "x" * size}


def test_records_reach_the_file_in_order_through_a_small_ring_that_wraps_and_fills(tmp_path, monkeypatch):
    monkeypatch.setenv(spool.RING_ENV, "4096")  # messages of up to 3 KB: most do not fit twice; many start over
    rec = Recorder()
    rec.activate(tmp_path)
    sizes = np.random.default_rng(0).integers(1, 3000, 400)
    for i, size in enumerate(sizes):
        rec.write(_record(i, int(size)))
    assert rec._spool is not None and not rec._spool.exited  # a helper took them
    rec.close()
    got = _lines(tmp_path)
    assert [r["step"] for r in got] == list(range(len(sizes)))
    assert [len(r["payload"]) for r in got] == sizes.tolist()


def test_the_process_writes_what_its_killed_helper_left(tmp_path, monkeypatch):
    monkeypatch.setenv(spool.RING_ENV, "8192")
    rec = Recorder()
    rec.activate(tmp_path)
    for i in range(20):
        rec.write(_record(i))
    ring = rec._spool.ring
    deadline = time.monotonic() + 30
    while ring.counters[1] != ring.counters[0] and time.monotonic() < deadline:
        time.sleep(0.01)  # the helper wrote those 20
    rec._spool.proc.kill()
    rec._spool.proc.wait()
    for i in range(20, 400):  # into the ring until it is full: then the process writes them itself
        rec.write(_record(i, 200))
    assert rec._spool is None  # on its own from then on
    rec.close()
    assert [r["step"] for r in _lines(tmp_path)] == list(range(400))


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from vllm_tour.trace.writer import RECORDER as R
    R.activate(sys.argv[1])
    proc = {"role": "worker", "pid": os.getpid(), "rank": 0}
    static = ["CPUAttention", "LBHNC", "vec", [], 2, 2, 64, "attention.build", "a.target"]
    for step in range(1, 201):
        R.write({"step": step, "proc": proc, "kind": "scheduler-ish", "n": step}, flush=False)
        table = np.arange(step * 4, dtype=np.int32).reshape(step, 4) % 7
        R.send(["attention", proc, step, static, step, step, 0, step, 0, 4, 4],
               [np.arange(step + 1, dtype=np.int32), np.ones(step, np.int32), table, np.arange(step, dtype=np.int64)])
        R.flush()
    print(R._spool.proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush of anything: the helper has it all
""")


def _exited(pid: int, timeout: float = 10.0) -> bool:
    """Gone, or a zombie that nobody reaped yet (its parent is dead), within `timeout` seconds (a process
    closes its files before it is a zombie)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(line.startswith("State:") and "Z" in line for line in f):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_a_killed_process_loses_nothing_it_handed_over(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    helper = int(proc.stdout.split()[0])
    assert spool.wait_for_writers(tmp_path, timeout=60) == []  # the helper held the file until it was done
    assert _exited(helper)  # ... and then exited
    lines = _lines(tmp_path)
    assert [r["step"] for r in lines] == [s for s in range(1, 201) for _ in (0, 1)]
    attention = [r for r in lines if r["kind"] == "attention"]
    assert attention[0]["block_table_since"] is None and attention[-1]["block_table_since"] == 199  # built by the helper
    assert attention[-1]["query_lens"] == [1] * 200


def test_a_record_the_helper_cannot_build_is_written_as_the_probe_error(tmp_path):
    rec = Recorder()
    rec.activate(tmp_path)
    proc = {"role": "worker", "pid": os.getpid(), "rank": 0}
    rec.send(["prepare", proc, 3, ["r"], "tensors", False, True], [np.ones(1, np.int32)], flush=True)  # arrays missing
    rec.close()
    (error,) = _lines(tmp_path)
    assert (error["kind"], error["step"], error["probe"]) == ("probe_error", 3, "runner.prepare_inputs")
    assert error["error"].startswith("ValueError") and "_prepare" in error["traceback"]
