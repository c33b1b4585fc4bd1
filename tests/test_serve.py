"""`vllm-tour serve`: upstream's own OpenAI server on the tiny model, traced, under the official `openai` client.

One server per module (it takes ~30 s to start on 2 idle cores, longer on a busy machine): 8 concurrent
streaming chat completions, a completion with n=2, a stream the client closes after 3 chunks, then a last
small request (so a step runs after the abort and its freed blocks show in that step's KV record); then
a completion cut by a stop string; then SIGINT, as Ctrl-C sends it. The tests read the run it leaves.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from vllm_tour.paths import REPO_ROOT
from vllm_tour.trace.reader import load_run

openai = pytest.importorskip("openai")  # a test extra (pyproject [test]), not a runtime dependency

START_S = 600  # a shared 2-core machine has taken ~100 s
MODEL = "tiny-qwen3"


def _lines(proc) -> queue.Queue:
    """The server command's output lines, read on a thread so the test can wait for one with a deadline."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_for(q: queue.Queue, pattern: str, seen: list[str], timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s; output:\n{''.join(seen)}")


def _chat_stream(client, i: int) -> dict:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"question number {i}"}],
                                            max_tokens=12, temperature=0, stream=True)
    api_id, text, finish = None, "", None
    for chunk in stream:
        api_id = chunk.id
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return {"id": api_id, "text": text, "finish": finish}


def _await_abort(run_dir, timeout: float = 60, count: int = 1) -> bool:
    """Until the EngineCore has written `count` abort records (an abort reaches it asynchronously: a closed stream's
    through the disconnect, a stop string's after the front end has already answered the client)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(f.read_bytes().count(b'"kind":"abort"') for f in run_dir.glob("records.*.jsonl")) >= count:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "run"
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    # Started as a shell starts `vllm-tour serve &`: SIGINT ignored. The SIGINT below must stop it all the same.
    # --level full: the streamed tokens are checked against the runner records of the CPU worker
    proc = subprocess.Popen([sys.executable, "-m", "vllm_tour", "serve", "--level", "full", "--out", str(out)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    seen: list[str] = []
    try:
        q = _lines(proc)
        url = _wait_for(q, r"serving (http://127\.0\.0\.1:\d+/v1)", seen, START_S).group(1)
        started_s = time.monotonic() - t0
        client = openai.OpenAI(base_url=url, api_key="not-checked", max_retries=0, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            chats = list(pool.map(lambda i: _chat_stream(client, i), range(8)))
        n2 = client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, n=2, temperature=1.0, seed=7)

        # Long enough (ignore_eos, ~1000 tokens) that it is still generating when the client hangs up.
        stream = client.completions.create(model=MODEL, prompt="a long story", max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        got = []
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                break
        stream.close()
        assert _await_abort(out), "the engine recorded no abort within 60 s of the client closing its stream"
        last = client.completions.create(model=MODEL, prompt="after the abort", max_tokens=2)
        # A stop string: the front end finds it in the text and has the engine drop the request (an abort there).
        plain = client.completions.create(model=MODEL, prompt="stop here", max_tokens=12, temperature=0).choices[0].text
        stop = next(c for c in plain[1:] if c.isalnum())  # greedy: the same text again, cut at this character
        stopped = client.completions.create(model=MODEL, prompt="stop here", max_tokens=12, temperature=0, stop=[stop])
        # The client has its answer before the front end's abort reaches the engine: a SIGINT now can beat it.
        # No assert: an engine that finished the request first records no abort, and the proof says so.
        _await_abort(out, timeout=30, count=2)

        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        _wait_for(q, r"stopped after", seen, 120)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return SimpleNamespace(out=out, rc=rc, output="".join(seen), chats=chats, n2=n2, aborted_id=got[0].id, last=last,
                           stopped=stopped, stop=stop, started_s=started_s, run=load_run(out))


def test_serve_stops_cleanly_and_leaves_a_complete_run(served, cli):
    assert served.rc == 0, served.output
    run = served.run
    assert run.meta.status == "ok" and run.finished and not run.warnings and not run.errors
    assert run.meta.engine_args["mode"] == "serve" and run.meta.engine_args["block_size"] == 32
    assert run.meta.engine_args["dtype"] == "float32"
    argv = run.meta.engine_args["server"]["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert not any("not-checked" in v for v in [*argv, *run.meta.env.values()])  # the client's key is never recorded
    assert (served.out / "server.log").is_file() and (served.out / "outputs.json").is_file()
    print(f"server ready in {served.started_s:.0f} s")


def test_serve_records_every_api_id_with_its_engine_requests(served):
    by_api: dict[str, list] = {}
    for r in served.run.server_requests:
        by_api.setdefault(r.api_id, []).append(r)
    chat_ids = [c["id"] for c in served.chats]
    assert len(set(chat_ids)) == 8 and all(i.startswith("chatcmpl-") for i in chat_ids)
    for api_id in [*chat_ids, served.n2.id, served.aborted_id, served.last.id]:
        assert api_id in by_api, f"{api_id} not recorded (recorded: {sorted(by_api)})"
    # n=2: two engine requests, children "<index>_<parent>", one per choice the client got
    kids = sorted(by_api[served.n2.id], key=lambda r: r.index)
    assert [k.index for k in kids] == [0, 1] and {k.n for k in kids} == {2}
    assert kids[0].parent_id == kids[1].parent_id and all(k.req_id.startswith(f"{k.index}_") for k in kids)
    assert sorted(k.text for k in kids) == sorted(c.text for c in served.n2.choices)
    for r in served.run.server_requests:
        assert r.arrival_time <= r.finished_time
        if r.finish_reason != "abort":
            assert r.first_token_time is not None and r.arrival_time <= r.first_token_time <= r.finished_time
    # every engine request the server made ran in the engine's steps
    scheduled = {x.req_id for s in served.run.steps if s.scheduler for x in s.scheduler.scheduled}
    assert {r.req_id for r in served.run.server_requests} <= scheduled


def test_streamed_text_equals_the_recorded_tokens(served):
    from tokenizers import Tokenizer

    run = served.run
    tok = Tokenizer.from_file(str(load_run(served.out).meta.model_path) + "/tokenizer.json")
    engine_tokens: dict[str, list[int]] = {}
    for s in run.steps:  # what the engine sampled, step by step (the CPU worker's runner records)
        for rec in s.runner.values():
            for rid, ids in rec.sampled_token_ids.items():
                engine_tokens.setdefault(rid, []).extend(ids)
    by_api = {r.api_id: r for r in run.server_requests}
    for chat in served.chats:
        rec = by_api[chat["id"]]
        assert rec.finish_reason == chat["finish"]
        assert engine_tokens[rec.req_id] == rec.token_ids  # the engine's tokens reached the front end unchanged
        assert rec.text == chat["text"]  # and the client got exactly their text
        # The same text from the ids alone, but for a last incomplete UTF-8 character (random weights emit byte
        # tokens): upstream's incremental detokenizer holds such a tail back, a one-shot decode shows it as U+FFFD.
        assert tok.decode(rec.token_ids, skip_special_tokens=True).rstrip("\ufffd") == chat["text"].rstrip("\ufffd")


def test_client_disconnect_is_an_abort_at_a_step_with_its_blocks_freed(served):
    run = served.run
    rec = next(r for r in run.server_requests if r.api_id == served.aborted_id)
    assert rec.finish_reason == "abort" and len(rec.token_ids) >= 3
    aborts = [(s, a) for s in run.steps for a in s.aborts if a.req_id == rec.req_id]
    assert len(aborts) == 1, aborts
    step, a = aborts[0]
    assert a.status_before == "RUNNING" and a.num_output_tokens >= 3
    assert a.block_ids and a.freed_block_ids == a.block_ids  # no prefix shared: every block it held is free again
    assert step.scheduler is not None and rec.req_id in {x.req_id for x in step.scheduler.scheduled}
    # the next step (the request after it) names it finished and returns its blocks in the KV record
    nxt = next(s for s in run.steps if s.index > step.index and s.scheduler)
    assert rec.req_id in nxt.scheduler.finished and set(a.freed_block_ids) <= set(nxt.kv.freed)
    assert rec.req_id not in nxt.kv.block_tables


def test_show_reads_the_served_run(served, cli):
    r = cli("show", served.out)
    assert r.returncode == 0, r.stderr
    assert "ABORT" in r.stdout and "server requests" in r.stdout and served.n2.id in r.stdout


def test_explain_rebuilds_the_served_queues_from_the_records(served):
    """Requests arrive whenever clients send them: the waiting queue is rebuilt from the front end's arrival times
    and the recorded waiting counts, and must match the recorded queue lengths at every step."""
    from vllm_tour.views.explain import _Explainer

    ex = _Explainer(served.run)
    assert ex.tl.states and all(st.consistent for st in ex.tl.states.values())
    first = {}
    for s in served.run.steps:
        for x in s.scheduler.scheduled:
            first.setdefault(x.req_id, s.index)
    for r in served.run.server_requests:  # each reached the engine by the step that first scheduled it, not after
        assert ex.tl.arrived[r.req_id] <= first[r.req_id], r.req_id
    # every admission's new blocks are the head of the free queue rebuilt under the pin's policy
    assert ex.allocs and all(a.expected == a.blocks for a in ex.allocs.values())


def test_explain_tells_the_abort_story_by_api_id(served, cli):
    r = cli("explain", served.out, "--request", served.aborted_id, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    rec = next(x for x in served.run.server_requests if x.api_id == served.aborted_id)
    assert data["subject"] == f"request {rec.req_id}"  # the API id named its engine request
    step, a = next((s.index, a) for s in served.run.steps for a in s.aborts if a.req_id == rec.req_id)
    (ln,) = [x for x in data["lines"] if x["topic"] == "finish"]
    assert ln["cause"] == "client_closed" and ln["steps"] == [step, step]
    nxt = next(s.index for s in served.run.steps if s.index > step and s.kv)
    assert f"{a.freed_block_ids} went back to the free list (step {nxt}'s kv.freed)" in ln["text"]
    assert f"while {a.status_before}" in ln["text"] and "When the client hung up is not recorded" in ln["text"]
    # the step view tells it too, under the request's engine id
    at = json.loads(cli("explain", served.out, "--step", step, "--json").stdout)
    assert [(x["request"], x["cause"]) for x in at["lines"] if x["topic"] == "finish" and x["cause"] is not None] == \
        [(rec.req_id, "client_closed")]


def test_explain_says_a_stop_string_ended_it(served):
    """The engine does not look for stop strings: the front end finds one and has the engine drop the request --
    an abort in the engine's records, a stop for the client. explain tells the two apart."""
    from vllm_tour.views.explain import explain

    assert served.stopped.choices[0].finish_reason == "stop"
    (ln,) = [x for x in explain(served.run, request=served.stopped.id).lines if x.topic == "finish"]
    assert ln.cause == "stop_string" and f"found a stop string {served.stop!r}" in ln.text()
    rec = next(r for r in served.run.server_requests if r.api_id == served.stopped.id)
    assert rec.stop_reason == served.stop and any(a.req_id == rec.req_id for s in served.run.steps for a in s.aborts)


def test_explain_is_silent_where_served_arrivals_do_not_fit(served, tmp_path):
    """A waiting count the front end's arrivals cannot make (more newcomers than requests made by then): the
    arrival step of those requests, and the queues at that step, are not established, and explain says so."""
    import shutil

    from vllm_tour.views.explain import _Explainer, explain

    step = next(s for s in served.run.steps if s.scheduler.waiting_before > 0)
    run_dir = tmp_path / "run"
    shutil.copytree(served.out, run_dir)
    for f in run_dir.glob("records.*.jsonl"):
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        for rec in lines:
            if rec["kind"] == "scheduler" and rec["step"] == step.index:
                rec["waiting_before"] = len(served.run.server_requests) + 1
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = load_run(run_dir)
    states = _Explainer(run).tl.states
    assert not any(st.consistent for n, st in states.items() if n >= step.index)  # lost from there on, never guessed
    first = {}
    for s in served.run.steps:
        for x in s.scheduler.scheduled:
            first.setdefault(x.req_id, s.index)
    later = [rid for rid, n in first.items() if n >= step.index]
    assert later
    for rid in later:
        (ln,) = [x for x in explain(run, request=rid).lines if x.topic == "arrival" and x.cause in ("api", "unknown")]
        assert ln.cause == "unknown" and "is not established" in ln.text(), rid


def test_explain_names_an_n2_childs_parent(served, cli):
    kids = sorted((x for x in served.run.server_requests if x.api_id == served.n2.id), key=lambda x: x.index)
    r = cli("explain", served.out, "--request", kids[1].req_id, "--json")
    assert r.returncode == 0, r.stderr
    (ln,) = [x for x in json.loads(r.stdout)["lines"] if x["cause"] == "n_child"]
    assert f"n = 2 choices the client asked for in {served.n2.id} (index 1)" in ln["text"]
    assert kids[1].parent_id in ln["text"] and kids[0].req_id in ln["text"]
    both = cli("explain", served.out, "--request", served.n2.id)  # the API id of two engine requests: name one
    assert both.returncode == 2 and both.stderr.strip().count("\n") == 0
    assert f"{kids[0].req_id}, {kids[1].req_id}" in both.stderr


def test_serve_refuses_a_port_in_use_and_leaves_no_run_dir(cli, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("serve", "--port", port, "--out", tmp_path / "run", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: port {port} on 127.0.0.1 is in use: give another --port, or leave it out for a free one"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, message", [
    (("--model", "no-such-model"), "model 'no-such-model' not found"),
    (("--", "--host", "0.0.0.0"), "--host after --: the server listens on 127.0.0.1 only"),
])
def test_serve_bad_input_is_one_line(cli, tmp_path, args, message):
    r = cli("serve", "--out", tmp_path / "run", *args, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_serve_reports_an_option_upstream_rejects(cli, tmp_path):
    # Upstream's own parser refuses it (~15 s: the server imports vLLM first); nothing is left behind.
    r = cli("serve", "--out", tmp_path / "run", "--", "--no-such-option", timeout=START_S)
    assert r.returncode == 2, r.stdout + r.stderr
    # the last line (importing vLLM may print its own notices before it)
    assert r.stderr.strip().splitlines()[-1] == ("error: upstream's server exited (2) before it was ready: "
                                                 "unrecognized arguments: --no-such-option")
    assert not (tmp_path / "run").exists()


def test_server_arguments_are_redacted_by_name_not_by_the_word_token():
    """Secrets leave meta.json; a token budget is no secret and stays."""
    from vllm_tour.engine.serve import redact

    argv = ["--max-num-batched-tokens", "32", "--api-key", "s3cret", "--hf-token=hf_x", "--max-num-seqs", "4"]
    assert redact(argv) == ["--max-num-batched-tokens", "32", "--api-key", "<redacted>", "--hf-token=<redacted>",
                            "--max-num-seqs", "4"]


def test_the_serving_notes_claims_hold_on_the_served_run(served):
    """The serving-path notes' claims (annotations/proofs/v0.32.0.toml, `scenario = "serve"`) checked on the run
    this module's server leaves: n = 2 children, the closed stream's abort and freed blocks, tokens unchanged
    front to back, the stop string an abort in the engine. VLLM_TOUR_RECORD_SERVE=1 keeps the run (small, no
    tensors) as the serve run `annotations verify` and the site use (traces/golden/proofs/v0.32.0/serve)."""
    from vllm_tour.engine.golden import write_golden
    from vllm_tour.notes import verify

    table = verify.proofs_for_pin("v0.32.0")
    serve = [n for n, p in table.items() if p.scenario == verify.SERVE]
    assert len(serve) >= 6
    verdicts = verify.check_claims(served.run, verify.SERVE, serve, table)
    assert all(v.holds for v in verdicts), [(v.note, v.step, v.evidence) for v in verdicts if not v.holds]
    by_note = {v.note: v.evidence for v in verdicts}
    kids = sorted((r for r in served.run.server_requests if r.api_id == served.n2.id), key=lambda r: r.index)
    assert f"{served.n2.id} (n = 2): engine requests {kids[0].req_id}" in by_note["serve-add-request-fanout"]
    assert f"{served.aborted_id}: the client saw abort" in by_note["serve-generate-abort"]
    assert f"{served.stopped.id}: the client saw stop on {served.stop!r}" in by_note["serve-stop-string-abort"]
    for v in verdicts:
        print(f"{v.note}: {v.evidence}")
    if os.environ.get("VLLM_TOUR_RECORD_SERVE") == "1":
        dest = write_golden(served.run, verify.recorded_run("v0.32.0", verify.SERVE), drop_capture_records=True)
        print(f"kept {dest} ({sum(f.stat().st_size for f in dest.iterdir()) // 1024} KiB)")
