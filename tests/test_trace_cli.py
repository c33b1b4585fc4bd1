"""The user's view: `vllm-tour show/export/trace` output, exit codes and one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tour.paths import GOLDEN_DIR, REPO_ROOT
from vllm_tour.views.perfetto import to_chrome_trace
from vllm_tour.trace.reader import load_run


def test_show_renders_preemption_and_the_block_grid(cli):
    r = cli("show", str(GOLDEN_DIR / "preemption"))
    assert r.returncode == 0, r.stderr
    assert "PREEMPT r2" in r.stdout and "block tables after step" in r.stdout and "outputs" in r.stdout


def test_show_step_explains_the_preemption(cli):
    run = load_run(GOLDEN_DIR / "preemption")
    step = next(s.index for s in run.steps if s.scheduler.preempted)
    r = cli("show", "preemption", "--step", str(step))  # a golden name resolves too
    assert r.returncode == 0, r.stderr
    assert "preempted r2: no free KV blocks" in r.stdout and "slot_mapping" in r.stdout


def test_show_request_follows_one_request(cli):
    r = cli("show", "shared_prefix", "--request", "second")
    assert r.returncode == 0, r.stderr
    assert "hit second:64t" in r.stdout and "second: blocks per step" in r.stdout and "1* 2* 4+" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("show", "/nonexistent/run"), "no run directory /nonexistent/run"),
        (("show", "single", "--step", "999"), "has no step 999"),
        (("show", "single", "--request", "zz"), "no request 'zz'"),
        (("export", "single", "--format", "svg"), "unknown format 'svg'"),
        (("trace",), "nothing to run"),
        (("trace", "-r", "hi", "--capture", "logits"), "unknown capture 'logits'"),
        (("trace", "-r", "hi", "--block-size", "16"), "multiple of 32"),
        (("trace", "-r", "hi", "--pin", "v0.0.1"), "no pin 'v0.0.1'"),
        (("trace", "-r", "hi", "--model", "Nope-7B"), "Nope-7B"),
        # no hub here: a real model name says where it looked and suggests the tiny default
        (("trace", "-r", "hi", "--model", "Qwen3-0.6B"), "models--Qwen--Qwen3-0.6B"),
    ],
)
def test_errors_are_one_line_with_exit_2(args, message, cli):
    r = cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_failed_trace_leaves_no_run_directory(tmp_path, cli):
    out = tmp_path / "run"
    r = cli("trace", "-r", "hi", "--model", "Qwen3-0.6B", "--out", str(out))
    assert r.returncode == 2 and "try --model tiny-qwen3" in r.stderr
    assert not out.exists()


def test_help_teaches(cli):
    r = cli("trace", "--help")
    assert r.returncode == 0 and "--num-blocks" in r.stdout and "preemption" in r.stdout and "chunked prefill" in r.stdout


def _check_chrome_trace(data):
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    for ev in data["traceEvents"]:
        assert {"ph", "pid", "tid", "name"} <= ev.keys(), ev
        if ev["ph"] == "X":
            assert isinstance(ev["ts"], (int, float)) and ev["dur"] > 0
        elif ev["ph"] == "C":
            assert isinstance(ev["ts"], (int, float)) and ev["args"] and all(isinstance(v, (int, float)) for v in ev["args"].values())
        elif ev["ph"] == "i":
            assert ev["s"] in "gpt" and isinstance(ev["ts"], (int, float))
        elif ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name") and ev["args"]["name"]
        else:
            pytest.fail(f"unexpected phase {ev['ph']}")


@pytest.mark.parametrize("name", ["preemption", "chunked_prefill", "shared_prefix"])
def test_perfetto_export_structure(name):
    run = load_run(GOLDEN_DIR / name)
    data = to_chrome_trace(run)
    _check_chrome_trace(data)
    evs = data["traceEvents"]
    assert sum(1 for e in evs if e["ph"] == "X" and e["tid"] == 1) == len(run.steps)
    names = {e["name"] for e in evs}
    assert {"KV usage", "requests", "decode"} <= names
    if name == "preemption":
        assert "preempted" in names and any(n.startswith("resumed") for n in names) and "waiting" in names
    if name == "chunked_prefill":
        assert sum(1 for n in names if n.startswith("prefill ")) >= 3


def test_export_command_writes_a_file(tmp_path, cli):
    out = tmp_path / "t.json"
    r = cli("export", "preemption", "--out", str(out))
    assert r.returncode == 0, r.stderr
    _check_chrome_trace(json.loads(out.read_text()))


def test_show_step_lists_only_that_steps_finishes(cli):
    from vllm_tour.views.show import last_steps

    run = load_run(GOLDEN_DIR / "preemption")
    finishes = last_steps(run)  # step -> requests whose last token was computed then
    quiet = next(s.index for s in run.steps if s.scheduler.preempted and s.index not in finishes)
    r = cli("show", "preemption", "--step", str(quiet))
    assert r.returncode == 0, r.stderr
    assert f"step {quiet} of {len(run.steps)}" in r.stdout and "finish " not in r.stdout
    last = max(finishes)
    r = cli("show", "preemption", "--step", str(last))
    assert all(f"finish {f}" in r.stdout for f in finishes[last])


def test_show_explains_the_null_block(cli):
    run = load_run(GOLDEN_DIR / "preemption")
    usable = run.steps[0].kv.num_blocks
    r = cli("show", "preemption")
    assert f"KV blocks {usable} usable + 1 null (block 0" in r.stdout and f"/{usable} " in r.stdout


# 31 tokens with the tiny model's tokenizer: one short of max_model_len 32, the longest prompt upstream accepts.
LONGEST_PROMPT = "the engine schedules requests in steps and each step fits a token budget while blocks"


def test_trace_force_replaces_a_run_dir_and_the_longest_prompt_runs(tmp_path, cli):
    out = tmp_path / "run"
    out.mkdir()
    (out / "records.999.jsonl").write_text('{"stale": true}\n')
    r = cli("trace", "-r", LONGEST_PROMPT, "--max-model-len", "32", "--out", out, "--force")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert not (out / "records.999.jsonl").exists()
    run = load_run(out)
    assert run.meta.status == "ok" and len(run.outputs.requests[0].prompt_token_ids) == 31
    assert "random weights" in r.stdout
    r = cli("trace", "-r", LONGEST_PROMPT + " and", "--max-model-len", "32", "--out", tmp_path / "run2")
    assert r.returncode == 2 and "allows at most 31" in r.stderr and not (tmp_path / "run2").exists()


def test_the_readme_chunked_prefill_example_is_longer_than_its_budget():
    import re

    from tokenizers import Tokenizer

    from vllm_tour.upstream.models import tokenizer_json
    from vllm_tour.paths import REPO_ROOT

    line = next(x for x in (REPO_ROOT / "README.md").read_text().splitlines() if "# chunked prefill" in x)
    budget = int(re.search(r"--max-num-batched-tokens (\d+)", line).group(1))
    prompt = re.search(r'-r "([^"]+)"', line).group(1)
    assert len(Tokenizer.from_file(str(tokenizer_json())).encode(prompt).ids) > budget  # else nothing chunks


def test_help_shows_flags_without_a_value_type_and_keeps_bracketed_words(cli):
    trace_help = cli("trace", "--help").stdout
    flags = [line for line in trace_help.splitlines() if line.startswith("  --") and any(f in line for f in ("--ignore-eos", "--multiprocess", "--force ", "--no-prefix-caching"))]
    assert len(flags) == 4 and not any("<bool>" in line for line in flags), flags
    for args in (["--help"], ["show", "--help"], ["annotations", "verify", "--help"]):  # the help option too
        out = cli(*args).stdout
        assert "Show this message and exit." in out and "<bool>" not in out, args
    top = cli("--help", columns=80).stdout  # every command's summary whole at 80 columns, none cut with "..."
    commands = top[top.index("Commands:"):]
    assert "..." not in commands and "cache" in commands and max(map(len, top.splitlines())) <= 80
    repro_help = cli("repro", "--help").stdout
    assert "Expectations ([expect], every pin; [expect.\"v0.21.0\"], that pin only)" in repro_help
    assert "with an [expect] section" in repro_help


def test_show_names_the_notes_behind_each_event(cli):
    """A preemption, a prefix hit, an eviction in the trace lead to the notes on the code that made them, read on
    the run's pin (the golden preemption run: recorded live, its events are real)."""
    from vllm_tour.notes.annotations import all_notes, load_all

    run = load_run(GOLDEN_DIR / "preemption")
    step = next(s for s in run.steps if s.scheduler and s.scheduler.preempted)
    res = cli("show", "preemption", "--step", str(step.index))
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())  # rich wraps at the terminal's width
    line = out.split("Preemption and recompute → notes:")[1]
    preempt_notes = [n.id for n in all_notes(load_all()) if "preemption" in n.concepts]
    assert preempt_notes and preempt_notes[0] in line
    quiet = next(s for s in run.steps if s.scheduler and not s.scheduler.preempted and not (s.kv and (s.kv.prefix_hits or s.kv.evicted))
                 and all(r.kind != "new" and not r.is_prefill for r in s.scheduler.scheduled))
    res = cli("show", "preemption", "--step", str(quiet.index))
    assert res.returncode == 0 and "→ notes:" not in res.stdout  # a plain decode step shows no event, so no note


def test_show_and_site_list_the_same_events(cli):
    """`show` and the site's trace page derive a step's events once: a request resumed after preemption is an
    admission in both (upstream re-admits it from the waiting queue like a new one), with the admission notes."""
    from vllm_tour.site.traces import trace_page
    from vllm_tour.views.event_notes import notes_by_concept, step_events

    run = load_run(GOLDEN_DIR / "preemption")
    step = next(s for s in run.steps if s.scheduler and any(r.kind == "resumed" for r in s.scheduler.scheduled))
    events = step_events(step)
    assert ("admission" in [e.concept for e in events]) and any(e.text.startswith("resume ") for e in events)
    out = " ".join(cli("show", "preemption", "--step", str(step.index)).stdout.split())
    assert "Request admission (waiting → running) → notes:" in out
    assert notes_by_concept(run.meta.pin)["admission"][0][0] in out.split("Request admission (waiting → running) → notes:")[1]
    _, page = trace_page(run, run.meta.pin, lambda nid: f"#{nid}")
    row = page.split(f'<tr id="step-{step.index}">')[1].split("</tr>")[0]
    assert all(f"ev-{e.concept}" in row and e.text in row and e.zh in row for e in events) and "resume " in row


def test_traces_at_once_get_their_own_run_dirs_and_latest_is_the_last_started(tmp_path, cli):
    """Two traces of the same prompt started together write two run dirs (one records file and one request
    each, never merged); "latest" is the last run started -- an --out run too -- and an export into an
    older run (which writes into its folder) does not make it latest."""
    runs = tmp_path / "runs"
    env = {"VLLM_TOUR_RUNS": str(runs)}
    older = tmp_path / "older"
    r = cli("trace", "-r", "same prompt", "--max-tokens", "2", "--out", older, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (runs / "latest").read_text().strip() == str(older.resolve())

    cmd = [sys.executable, "-m", "vllm_tour", "trace", "-r", "same prompt", "--max-tokens", "3", "--ignore-eos"]
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1", **env}) for _ in range(2)]
    results = [(p, *p.communicate(timeout=300)) for p in procs]
    assert all(p.returncode == 0 for p, _, _ in results), [e[-2000:] for _, _, e in results]
    dirs = sorted(d for d in runs.iterdir() if d.is_dir())
    assert len(dirs) == 2 and all("-same-prompt" in d.name for d in dirs), dirs
    printed = sorted(next(line.split("run dir: ")[1] for line in out.splitlines() if "run dir: " in line)
                     for _, out, _ in results)
    assert printed == [str(d) for d in dirs]  # each command names its own run
    for d in dirs:
        run = load_run(d)
        assert len(list(d.glob("records.*.jsonl"))) == 1 and len(run.meta.requests) == 1
        assert run.meta.status == "ok" and [len(o.token_ids) for o in run.outputs.requests] == [3]
        assert {s.scheduler.scheduled[0].req_id for s in run.steps} == {"r0"} and len(run.steps) == 3
    latest = Path((runs / "latest").read_text().strip())
    assert latest in dirs

    r = cli("export", older, env=env)
    assert r.returncode == 0 and (older / "trace.perfetto.json").is_file(), r.stderr
    r = cli("export", "latest", env=env)
    assert r.returncode == 0 and f"wrote {latest / 'trace.perfetto.json'} (3 steps)" in r.stdout, r.stdout + r.stderr
