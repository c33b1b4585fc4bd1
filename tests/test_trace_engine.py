"""Must-shows of issue 3, against the real upstream engine (runs shared via the trace_runs fixture)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_tour.paths import REPO_ROOT
from vllm_tour.engine.golden import GOLDEN_SCENARIOS
from vllm_tour.trace.reader import load_run


def tokens(run_dir):
    return {o["req_id"]: o["token_ids"] for o in json.loads((run_dir / "outputs.json").read_text())["requests"]}


@pytest.mark.parametrize("name", GOLDEN_SCENARIOS)
def test_probes_on_and_off_give_identical_greedy_outputs(trace_runs, name):
    on, off = trace_runs.get(name), trace_runs.get(name, probes=False)
    assert tokens(on) == tokens(off)
    assert list(off.glob("records.*.jsonl")) == []  # the untraced run really was untraced
    run = load_run(on)
    assert run.steps and not run.errors and not run.warnings


def test_preemption_names_request_step_reason_then_resumes(trace_runs):
    run = load_run(trace_runs.get("preemption"))
    events = [(s.index, p) for s in run.steps for p in s.scheduler.preempted]
    assert events, "the scenario must preempt"
    step, p = events[0]
    assert p.req_id == "r2"  # the newest running request is the victim (FCFS)
    assert "no free KV blocks" in p.reason and p.while_allocating_for in {"r0", "r1", "r2"}
    assert p.freed_block_ids and p.num_computed_tokens_lost > 0
    preempt_step = run.step(step)
    assert "r2" not in preempt_step.kv.block_tables
    assert set(p.freed_block_ids) <= set(preempt_step.kv.freed)
    later = [s for s in run.steps if s.index > step and any(r.req_id == "r2" for r in s.scheduler.scheduled)]
    resumed = later[0].scheduler.scheduled[[r.req_id for r in later[0].scheduler.scheduled].index("r2")]
    assert resumed.kind == "resumed" and resumed.is_prefill
    assert later[0].kv.block_tables["r2"], "blocks re-allocated on resume"
    assert len(tokens(run.path)["r2"]) == 60


def test_prefix_hit_reuses_the_first_requests_block_ids(trace_runs):
    run = load_run(trace_runs.get("shared_prefix"))
    hits = [(s, h) for s in run.steps for h in s.kv.prefix_hits if h.req_id == "second"]
    assert hits, "second must hit the prefix cache"
    step, hit = hits[0]
    first_blocks = next(s.kv.block_tables["first"] for s in run.steps if "first" in s.kv.block_tables)
    assert hit.num_hit_tokens == 64 and hit.block_ids == first_blocks[:2]
    assert step.kv.block_tables["second"][:2] == first_blocks[:2]
    assert not set(step.kv.allocated["second"]) & set(first_blocks)


def test_chunked_prefill_splits_the_long_prompt(trace_runs):
    run = load_run(trace_runs.get("chunked_prefill"))
    chunks = [r for s in run.steps for r in s.scheduler.scheduled if r.req_id == "long" and r.is_prefill]
    assert len(chunks) >= 2 and all(s.scheduler.tokens_scheduled <= 32 for s in run.steps)
    assert [c.num_computed_tokens for c in chunks] == sorted(c.num_computed_tokens for c in chunks)


def test_runner_and_attention_agree_with_the_scheduler(trace_runs):
    run = load_run(trace_runs.get("concurrent8"))
    for s in run.steps:
        r, a = s.runner[0], s.attention[0]
        assert r.num_tokens == s.scheduler.tokens_scheduled == sum(r.num_scheduled_tokens)
        assert {x.req_id: x.num_scheduled_tokens for x in s.scheduler.scheduled} == dict(zip(r.req_ids, r.num_scheduled_tokens))
        for rid, row in zip(r.req_ids, a.block_table):
            assert row == s.kv.block_tables[rid][: len(row)]
        assert a.query_lens == r.num_scheduled_tokens and a.seq_lens == r.seq_lens


def test_tp2_records_both_ranks(trace_runs):
    run = load_run(trace_runs.get("tp2"))
    for s in run.steps:
        assert sorted(s.runner) == [0, 1] and s.runner[0].sampled_token_ids == s.runner[1].sampled_token_ids


def test_a_probe_that_raises_changes_nothing_and_is_recorded(trace_runs):
    faulty = trace_runs.get("single", fault="attention.build")
    assert tokens(faulty) == tokens(trace_runs.get("single", probes=False))
    run = load_run(faulty)
    assert run.errors and all(e.probe == "attention.build" for e in run.errors)
    assert "forced fault" in run.errors[0].error and run.errors[0].step == 1
    assert run.steps[0].scheduler is not None  # the other probes kept recording
    # the GPU runner's trace step fails such a run, naming the probe (it once reported "ok" over 28 errors)
    from vllm_tour.gpu.runner import probe_errors

    summary = probe_errors(faulty)
    assert summary["status"] == "probe_errors" and summary["probe_errors"] == len(run.errors)
    assert summary["first_probe_error"].startswith("attention.build: RuntimeError: forced fault")
    assert probe_errors(trace_runs.get("single")) == {}


def test_multiprocess_engine_core_records_from_its_own_process(trace_runs):
    mp = trace_runs.get("single", multiprocess=True)
    assert tokens(mp) == tokens(trace_runs.get("single"))
    run = load_run(mp)
    assert run.steps and {s.scheduler.proc.pid for s in run.steps} != {os.getpid()}


def test_captures_are_safetensors_named_by_layer(trace_runs):
    from safetensors.torch import load_file

    run = load_run(trace_runs.get("single", capture=["attn_out,kv_blocks"], capture_steps="1-2"))
    names = {(c.step, c.name) for s in run.steps for c in s.captures}
    assert names == {(st, f"{k}.layers.{i}") for st in (1, 2) for k in ("attn_out", "kv_blocks") for i in (0, 1)}
    c = next(c for c in run.step(1).captures if c.name == "attn_out.layers.0")
    t = load_file(str(run.path / c.file))[c.tensor]
    assert list(t.shape) == c.shape == [run.step(1).runner[0].num_tokens, 4 * 64]
    kvc = next(c for c in run.step(1).captures if c.name == "kv_blocks.layers.0")
    assert kvc.block_ids == run.step(1).kv.block_tables["r0"]



def _long_trace(out, **popen_kw) -> subprocess.Popen:
    """`vllm-tour trace` of 900 tokens into `out`, in its own process group (a terminal's Ctrl-C reaches all of it)."""
    cmd = [sys.executable, "-m", "vllm_tour.cli", "trace", "-r", "hello", "--max-tokens", "900", "--ignore-eos", "--out", str(out)]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True, **popen_kw)


def _wait_for_steps(out, lines: int = 40, timeout: float = 240) -> list:
    """The run's records files once the first holds `lines` records: the engine is stepping."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        files = list(out.glob("records.*.jsonl"))
        if files and files[0].read_text().count("\n") > lines:
            return files
        time.sleep(0.2)
    pytest.fail("the traced run never got going")

def test_sigkill_mid_run_leaves_a_trace_show_reads(tmp_path):
    out = tmp_path / "killed"
    proc = _long_trace(out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        files = _wait_for_steps(out)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with open(files[0], "a") as f:
        f.write('{"step": 99, "kind": "sched')  # what a kill mid-write leaves
    run = load_run(out)
    assert run.meta.status == "running" and run.outputs is None and len(run.steps) >= 10
    assert any("truncated last line" in w for w in run.warnings)
    shown = subprocess.run([sys.executable, "-m", "vllm_tour.cli", "show", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "did not finish" in shown.stdout and "r0:D" in shown.stdout


def test_ctrl_c_mid_run_says_where_the_partial_run_is_and_labels_it_interrupted(tmp_path):
    """SIGINT to the command's process group, as a terminal's Ctrl-C sends it, once steps are being written."""
    out = tmp_path / "interrupted"
    proc = _long_trace(out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env={**os.environ, "VLLM_TOUR_RUNS": str(tmp_path / "runs")})
    try:
        _wait_for_steps(out)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert f"interrupted: the partial run is in {out} (vllm-tour show {out})" in stderr.splitlines()
    assert "Traceback" not in stderr
    run = load_run(out)
    assert run.meta.status == "interrupted" and "KeyboardInterrupt" not in (run.meta.error or "")
    assert run.outputs is None and len(run.steps) >= 10
    assert "the run was interrupted (Ctrl-C): showing the steps it flushed" in run.warnings


def test_arrival_steps_are_honoured_in_process(trace_runs):
    run = load_run(trace_runs.get("arrivals"))
    first = {}
    for s in run.steps:
        for r in s.scheduler.scheduled:
            first.setdefault(r.req_id, (s.index, r.kind))
    assert first == {"a": (1, "new"), "b": (3, "new"), "c": (6, "new")}
