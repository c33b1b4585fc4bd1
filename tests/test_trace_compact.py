"""The probes' compact records (scheduled as columns, block tables as deltas) and the reader that expands them.

Faithfulness itself is test_trace_golden's: a fresh run, written compactly, reads back equal to the
golden traces, which hold full tables. These tests show that the compact form is what is written, that
every delta has its base, and that a delta without one is a clear error.
"""

import json
import shutil

import pytest

from vllm_tour.errors import TourError
from vllm_tour.probes import install as inst
from vllm_tour.trace.reader import load_run


def _raw(run_dir) -> list[dict]:
    return [json.loads(line) for f in sorted(run_dir.glob("records.*.jsonl")) for line in f.read_text().splitlines()]


def test_hot_records_are_written_compact_and_read_back_whole(trace_runs):
    run_dir = trace_runs.get("concurrent8")
    raw, run = _raw(run_dir), load_run(run_dir)
    kv = [r for r in raw if r["kind"] == "kv"]
    attn = [r for r in raw if r["kind"] == "attention"]
    # each KV / attention record after the first is a delta against the one before it
    assert kv[0]["block_tables_since"] is None and [r["block_tables_since"] for r in kv[1:]] == [r["step"] for r in kv[:-1]]
    assert attn[0]["block_table_since"] is None and [r["block_table_since"] for r in attn[1:]] == [r["step"] for r in attn[:-1]]
    # decode steps change few tables: the deltas hold less than the tables the reader gives back
    full_kv = {s.index: s.kv.block_tables for s in run.steps if s.kv}
    full_attn = {s.index: s.attention[0].block_table for s in run.steps if s.attention}
    assert sum(map(len, (r["block_tables"] for r in kv))) < sum(map(len, full_kv.values())) / 2
    assert sum(map(len, (r["block_table"] for r in attn))) < sum(map(len, full_attn.values())) / 2
    # ... and a request that released its blocks is named in the delta with an empty table
    released = [(r["step"], rid) for r in kv for rid, t in r["block_tables"].items() if t == []]
    assert released and all(rid not in full_kv[step] for step, rid in released)
    # the expanded tables agree with the rows the attention backend received, request by request
    for s in run.steps:
        if s.attention and s.runner:
            rows = dict(zip(s.runner[0].req_ids, s.attention[0].block_table))
            assert rows == {rid: full_kv[s.index][rid] for rid in rows}, s.index
    # scheduled rows as columns, read back as rows
    sched = next(r for r in raw if r["kind"] == "scheduler" and r["scheduled"]["req_id"])
    rows = run.step(sched["step"]).scheduler.scheduled
    assert [r.req_id for r in rows] == sched["scheduled"]["req_id"]
    assert [r.num_scheduled_tokens for r in rows] == sched["scheduled"]["num_scheduled_tokens"]


def test_a_delta_without_its_base_is_one_clear_error(trace_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trace_runs.get("concurrent8"), run)
    for f in run.glob("records.*.jsonl"):
        lines = f.read_text().splitlines(keepends=True)
        kv = [i for i, line in enumerate(lines) if json.loads(line)["kind"] == "kv"]
        if len(kv) > 2:
            del lines[kv[1]]
            f.write_text("".join(lines))
            break
    with pytest.raises(TourError, match=r"records\.\d+\.\d+\.jsonl:\d+: kv record of step 3 is a delta against step 2, "
                                        r"but the previous kv record of rank 0 in this file is step 1"):
        load_run(run)


def test_a_garbled_base_of_a_delta_is_skipped_and_later_tables_say_they_were_rebuilt(trace_runs, tmp_path):
    """A garbled KV record (not a removed one: that stays the error above) is skipped with a warning naming
    file:line; the deltas after it are rebuilt on the last table read, and a warning says they may miss its step."""
    run = tmp_path / "run"
    whole = trace_runs.get("concurrent8")
    shutil.copytree(whole, run)
    f = max(run.glob("records.*.jsonl"), key=lambda p: p.stat().st_size)
    lines = f.read_text().splitlines(keepends=True)
    kv = [i for i, line in enumerate(lines) if json.loads(line)["kind"] == "kv"]
    lost = json.loads(lines[kv[1]])["step"]
    lines[kv[1]] = lines[kv[1]][:30] + "\n"
    f.write_text("".join(lines))
    loaded, intact = load_run(run), load_run(whole)
    assert f"{f}:{kv[1] + 1}: skipped a line that is not a trace record" in "\n".join(loaded.warnings)
    assert any(w.startswith(f"{f}:{kv[2] + 1}: kv block tables of rank 0 from step {lost + 1} on are rebuilt")
               for w in loaded.warnings), loaded.warnings
    assert loaded.step(lost).kv is None and loaded.step(lost + 1).kv is not None
    assert [s.kv for s in loaded.steps if s.index < lost] == [s.kv for s in intact.steps if s.index < lost]


def test_tp_probes_are_left_out_of_a_tp1_run_only():
    names = {None: {p.name for p in inst.probes_for("v0.32.0")},
             1: {p.name for p in inst.probes_for("v0.32.0", tp_size=1)},
             2: {p.name for p in inst.probes_for("v0.32.0", tp_size=2)}}
    tp = {n for n in names[None] if n.startswith("tp.")}
    assert tp and names[None] == names[2] and names[1] == names[None] - tp


def test_the_writer_keeps_no_records_and_a_bounded_id_cache(tmp_path):
    """What a long traced run holds in memory: no written line, at most MAX_CACHED_IDS request ids."""
    from vllm_tour.trace.writer import MAX_CACHED_IDS, Recorder, user_req_id

    rec = Recorder()
    rec.activate(tmp_path)
    for i in range(3 * MAX_CACHED_IDS):
        uid = user_req_id(f"r{i}-{i:08x}")
        assert uid == f"r{i}"
        rec.write({"step": i, "kind": "scheduler", "req": uid}, flush=i % 2 == 1)  # pairs, as scheduler + KV
    assert rec._pending == [] and len(user_req_id.__self__) <= MAX_CACHED_IDS
    rec.deactivate()
    written = sum(len(f.read_text().splitlines()) for f in tmp_path.glob("records.*.jsonl"))  # index.jsonl beside them
    assert written == 3 * MAX_CACHED_IDS


def test_records_name_the_process_that_wrote_them_after_a_fork():
    """The writer reads its process id once; a child forked from a traced process (vLLM forks its
    EngineCore and workers) writes its own id, not its parent's."""
    import os

    from vllm_tour.trace.writer import RECORDER

    assert RECORDER.proc_dict("worker")["pid"] == os.getpid()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, str(RECORDER.proc_dict("engine_core")["pid"]).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    assert int(os.read(read, 32)) == child
