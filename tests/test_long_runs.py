"""Long runs (issue 32 item 3): records in segments with an index, windows of steps or time read alone.

One upstream run of the preemption scenario (83 steps) written in 10-step segments, against the same
scenario recorded with the default segment size (one segment): trace_runs' shared run.
"""

import json
import os
import shutil
from itertools import pairwise

import pytest
from rich.console import Console

from vllm_tour.trace.reader import (
    load_run,
    load_tail,
    read_index,
    read_records,
    steps_between,
)
from vllm_tour.trace.writer import SEGMENT_STEPS_ENV
from vllm_tour.views.show import step_table

SEGMENT = 10


@pytest.fixture(scope="module")
def segmented(tmp_path_factory):
    from vllm_tour.engine.run import run_upstream
    from vllm_tour.paths import SCENARIOS_DIR
    from vllm_tour.scenario import load_scenario

    os.environ[SEGMENT_STEPS_ENV] = str(SEGMENT)
    try:
        return run_upstream(load_scenario(SCENARIOS_DIR / "preemption.toml"), tmp_path_factory.mktemp("long") / "seg")
    finally:
        del os.environ[SEGMENT_STEPS_ENV]


def _raw(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_segments_are_indexed_and_self_contained(segmented, trace_runs):
    files = sorted(segmented.glob("records.*.jsonl"))
    index = read_index(segmented)
    assert len(files) == 9 and sorted(index) == [f.name for f in files]  # 83 steps in 10-step segments
    entries = [index[f.name] for f in files]
    assert [(e["first_step"], e["last_step"]) for e in entries] == [(s, min(s + SEGMENT - 1, 83)) for s in range(1, 84, SEGMENT)]
    assert all(e["first_time"] <= e["last_time"] and e["bytes"] == f.stat().st_size for e, f in zip(entries, files))
    whole = {s.index: s for s in load_run(trace_runs.get("preemption")).steps}
    for f in files:
        raw = _raw(f)
        # the first KV and attention record of every segment carries its tables in full, no delta
        assert next(r for r in raw if r["kind"] == "kv")["block_tables_since"] is None
        assert next(r for r in raw if r["kind"] == "attention")["block_table_since"] is None
        alone = read_records(f, warnings := [])
        assert not warnings
        for rec in alone:
            if rec.kind == "kv":
                assert rec.block_tables == whole[rec.step].kv.block_tables
            elif rec.kind == "attention":
                assert rec.block_table == whole[rec.step].attention[0].block_table


def _comparable(step):
    def drop(rec, *fields):
        return rec.model_dump(exclude={"proc", *fields}) if rec else None

    return (drop(step.scheduler, "time", "duration_s"), drop(step.kv), {r: drop(x) for r, x in step.runner.items()},
            {r: drop(x) for r, x in step.attention.items()}, [drop(e) for e in step.errors])


def test_segmented_run_equals_unsegmented(segmented, trace_runs):
    plain_dir = trace_runs.get("preemption")
    assert len(list(plain_dir.glob("records.*.jsonl"))) == 1
    seg, plain = load_run(segmented), load_run(plain_dir)
    assert not seg.warnings and [s.index for s in seg.steps] == list(range(1, 84))
    assert [_comparable(s) for s in seg.steps] == [_comparable(s) for s in plain.steps]


def _rows(run) -> dict[str, list[str]]:
    console = Console(width=200, record=True, color_system=None)
    console.print(step_table(run))
    rows = [line for line in console.export_text().splitlines() if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    return {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:]] for line in rows}


@pytest.mark.parametrize("window", [(1, 10), (36, 62), (37, 39), (80, 83), (83, 83), (59, 61)])
def test_window_rows_equal_the_full_table(segmented, window):
    full = _rows(load_run(segmented))
    part = load_run(segmented, steps=window)
    assert part.window == window and [s.index for s in part.steps] == list(range(window[0], window[1] + 1))
    assert _rows(part) == {k: v for k, v in full.items() if window[0] <= int(k) <= window[1]}
    assert any("finish" in " ".join(v) for v in full.values())  # the finishes are in the rows compared


def test_window_reads_only_its_segments(segmented, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(segmented, copy)
    for f in sorted(copy.glob("records.*.jsonl"))[:3] + sorted(copy.glob("records.*.jsonl"))[5:]:
        f.write_text("not a record\n" * 3)  # steps 1-30 and 51-83 unreadable: a window inside 31-50 never sees them
    part = load_run(copy, steps=(33, 48))
    assert not part.warnings and _rows(part) == _rows(load_run(segmented, steps=(33, 48)))
    assert load_run(copy).warnings  # the whole run does read them


def test_time_window_and_tail(segmented):
    run = load_run(segmented)
    times = {s.index: s.scheduler.time - run.meta.started for s in run.steps}
    t0, t1 = times[20], times[45]
    assert steps_between(segmented, (t0, t1)) == (20, 45)
    tail = load_tail(segmented, 5)
    assert [s.index for s in tail.steps] == [79, 80, 81, 82, 83]


@pytest.mark.parametrize("golden, args, message", [
    (False, ["--steps", "50-40"], "--steps 50-40: the range ends before it starts"),
    (False, ["--steps", "90-100"], "steps 90-100 are not in seg (it has steps 1..83)"),
    (False, ["--time", "ten-20"], "--time 'ten-20': give a range FIRST-LAST of seconds"),
    (False, ["--steps", "10-20", "--step", "3"], "give one of --step, --request, --steps, --time"),
    (True, ["--time", "0-5"], "preemption keeps no wall times (a golden run's are zeroed): give a window of steps instead"),
])
def test_bad_windows_exit_2(cli, segmented, golden, args, message):
    r = cli("show", "preemption" if golden else segmented, *args)
    assert r.returncode == 2 and r.stderr.startswith("error: " + message) and len(r.stderr.splitlines()) == 1, r.stderr


def test_show_steps_cli(cli, segmented):
    r = cli("show", segmented, "--steps", "36-40")
    assert r.returncode == 0, r.stderr
    assert "steps 36-40 (5 steps)" in r.stdout and "PREEMPT r2" in r.stdout


def test_recorder_state_holds_only_live_requests(tmp_path):
    """Hundreds of requests come and finish; what the Recorder keeps between steps is the live ones'."""
    from vllm_tour.bench.long_run import PROMPT_TOKENS, drive
    from vllm_tour.engine.run import engine_kwargs
    from vllm_tour.engine.sched_harness import _make_scheduler, scheduler_probes
    from vllm_tour.probes.base import install, uninstall
    from vllm_tour.probes.install import check_probes
    from vllm_tour.scenario import Scenario
    from vllm_tour.trace.writer import RECORDER, user_req_id
    from vllm_tour.upstream.models import resolve_model
    from vllm_tour.upstream.pins import active_pin_tag

    tag = active_pin_tag()
    scenario = Scenario.model_validate({"name": "state", "requests": [{"id": "r0", "token_ids": [5] * PROMPT_TOKENS}]})
    sched = _make_scheduler(engine_kwargs(scenario, resolve_model(scenario.model), tag), async_sched=False)
    resolved = check_probes(tag, probes=scheduler_probes())
    install(resolved, RECORDER)
    RECORDER.activate(tmp_path)
    try:
        drive(sched, 400, samples=1)
        manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
        holding = {user_req_id(r) for r, blocks in manager.req_to_blocks.items() if blocks}
        # the Recorder's view is of the last schedule(): the requests that finished in its update were live then
        live_then = holding | set(map(user_req_id, sched.finished_req_ids))
        assert len(holding) >= 8  # requests are live at the end, ~200 have finished
        assert holding <= set(RECORDER.kv_prev_tables) <= live_then
        assert set(map(user_req_id, RECORDER.kv_prev_keys)) <= live_then and len(RECORDER.kv_prev_sizes) == len(RECORDER.kv_prev_keys)
        assert set(RECORDER.sched_prev[1]) <= live_then
    finally:
        RECORDER.deactivate()
        uninstall(resolved)
    assert len(list(tmp_path.glob("records.*.jsonl"))) == 1


def test_a_segment_closes_at_its_byte_limit_on_a_step_boundary(tmp_path, monkeypatch):
    from vllm_tour.trace.schema import ProbeErrorRecord
    from vllm_tour.trace.writer import SEGMENT_BYTES_ENV, Recorder

    monkeypatch.setenv(SEGMENT_BYTES_ENV, "1000")
    rec = Recorder()
    rec.activate(tmp_path)
    for step in range(1, 31):
        rec.segment_boundary(step)
        for _ in range(2):  # two records a step: a step never splits across segments
            rec.write(ProbeErrorRecord(step=step, proc=rec.proc("engine_core"), probe="p", target="t", error="e", traceback="x" * 100))
    rec.deactivate()
    files = sorted(tmp_path.glob("records.*.jsonl"))
    index = read_index(tmp_path)
    assert len(files) > 3 and sorted(index) == [f.name for f in files]
    spans = [(index[f.name]["first_step"], index[f.name]["last_step"]) for f in files]
    assert spans[0][0] == 1 and spans[-1][1] == 30 and all(b[0] == a[1] + 1 for a, b in pairwise(spans))
    assert all(1000 <= f.stat().st_size < 1000 + 2 * 300 for f in files[:-1])
    assert [e.step for f in files for e in read_records(f, [])] == [s for s in range(1, 31) for _ in range(2)]


def test_a_bad_segment_size_stops_trace_before_the_engine(cli):
    r = cli("trace", "--request", "hi", env={SEGMENT_STEPS_ENV: "0"}, timeout=60)
    assert r.returncode == 2 and r.stderr == f"error: {SEGMENT_STEPS_ENV}=0: give a whole number above 0\n"
