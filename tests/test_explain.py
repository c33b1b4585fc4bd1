"""`vllm-tour explain`: every cause it states comes from records of a real upstream run whose scenario makes that
case happen, and a test checks the explanation names that cause at that step and no other.

Goldens (traces/golden/, traces/golden/proofs/v0.32.0/) are upstream runs checked in; one fresh run of the
preemption scenario (shared with the other tests through `trace_runs`) checks the headline story on this
machine's upstream, and its level-steps twin checks what is said without KV records.
"""

import json
import re
import shutil
import string

import pytest

from vllm_tour.errors import TourError
from vllm_tour.trace.reader import load_run
from vllm_tour.views.explain import explain
from vllm_tour.views.explain_messages import MSG

PROOFS = "traces/golden/proofs/v0.32.0/"


def _run(name):
    from vllm_tour.paths import REPO_ROOT

    return load_run(REPO_ROOT / "traces" / "golden" / name if not name.startswith("traces/") else REPO_ROOT / name)


def _causes_at(ex, step, topic):
    """The causes the explanation gives for `topic` at `step` (lines covering a step range count for each step)."""
    return {ln.cause for ln in ex.lines if ln.topic == topic and ln.steps and ln.steps[0] <= step <= ln.steps[1]}


def _lines_at(ex, step, topic):
    return [ln for ln in ex.lines if ln.topic == topic and ln.steps and ln.steps[0] <= step <= ln.steps[1]]


# --- why a request waited: one cause per scenario -------------------------------------------------------------


def test_wait_token_budget_names_the_requests_that_used_it():
    # cmp_chunked: budget 48; at step 4 short, long1 and long2 take all of it and tiny, just arrived, waits.
    run = _run(PROOFS + "cmp_chunked")
    ex = explain(run, request="tiny")
    assert _causes_at(ex, 4, "wait") == {"token_budget"}
    sch = run.step(4).scheduler
    assert sch.tokens_scheduled == sch.token_budget
    text = _lines_at(ex, 4, "wait")[0].text()
    assert f"{sch.tokens_scheduled}/{sch.token_budget}" in text
    for r in sch.scheduled:  # every user of the budget is named with its tokens
        assert f"{r.req_id} {r.num_scheduled_tokens}" in text


def test_wait_max_running():
    # cmp_concurrent: max_num_seqs 4, six requests: r4 and r5 wait for a running slot while budget is left.
    run = _run(PROOFS + "cmp_concurrent")
    ex = explain(run, request="r4")
    for n in range(1, 5):
        assert _causes_at(ex, n, "wait") == {"max_running"}, n
        sch = run.step(n).scheduler
        assert sch.running_after >= sch.max_num_seqs and sch.tokens_scheduled < sch.token_budget
    assert "max_num_seqs = 4" in _lines_at(ex, 1, "wait")[0].text()
    assert _causes_at(ex, 5, "admit") == {"new"}


def test_wait_kv_blocks_gives_needed_and_free():
    # proof_admission: b's whole 2040-token prompt needs 64 blocks; 63 are free while a holds one.
    run = _run(PROOFS + "proof_admission")
    ex = explain(run, request="b")
    for n in (2, 3, 4):
        assert _causes_at(ex, n, "wait") == {"kv_blocks"}, n
    ln = _lines_at(ex, 2, "wait")[0]
    assert ln.params["need"] == 64 and ln.params["free"] == run.step(2).kv.free_blocks == 63
    assert "kvm-reserve-full-isl" in ln.notes and "kv.free_blocks" in ln.fields


def test_wait_head_of_line_names_the_blocker():
    # proof_admission: d (5 tokens) would fit, but waits behind b, the first waiting request that does not.
    run = _run(PROOFS + "proof_admission")
    ex = explain(run, request="d")
    for n in (3, 4):
        assert _causes_at(ex, n, "wait") == {"head_of_line"}, n
    ln = _lines_at(ex, 3, "wait")[0]
    assert ln.params["head"] == "b"
    assert "d alone needed at most 1 block for 5 tokens" in ln.text()
    # then other limits hold it, each its own cause: the budget at step 5, free blocks at step 6
    assert _causes_at(ex, 5, "wait") == {"token_budget"}
    assert _causes_at(ex, 6, "wait") == {"kv_blocks"}


def test_wait_in_a_step_that_preempted():
    # cmp_preempt: at step 58 b preempts itself; c, waiting, is not admitted in a step that preempted.
    run = _run(PROOFS + "cmp_preempt")
    assert [p.req_id for p in run.step(58).scheduler.preempted] == ["b"]
    ex = explain(run, request="c")
    assert _causes_at(ex, 58, "wait") == {"preempt_gate"}
    assert _lines_at(ex, 58, "wait")[0].notes == ["sched-waiting-gate"]


# --- preemption: the victim rule, what was lost, when it came back ----------------------------------------------


def test_preemption_victim_is_the_last_running_request():
    # cmp_preempt: at step 26 b's decode needs a block; c, admitted last, is the FCFS victim.
    run = _run(PROOFS + "cmp_preempt")
    p = run.step(26).scheduler.preempted[0]
    assert (p.req_id, p.while_allocating_for) == ("c", "b")
    ex = explain(run, request="c")
    assert _causes_at(ex, 26, "preempt") == {"victim_last_running"}
    ln = _lines_at(ex, 26, "preempt")[0]
    assert "allocating for b" in ln.text() and f"lost {p.num_computed_tokens_lost} computed tokens" in ln.text()
    assert "sched-pick-victim" in ln.notes and "sched-preempt-reset" in ln.notes
    # b's story says c was preempted for it
    assert _causes_at(explain(run, request="b"), 26, "preempt") == {"preempted_for"}
    assert _causes_at(ex, 61, "resume") == {"resumed"}


def test_preemption_story_on_a_fresh_upstream_run(trace_runs):
    """The headline: r2 is preempted while allocating for itself (the last running request), waits for
    blocks, comes back with part of its prefix cached, the rest evicted for r1."""
    run = load_run(trace_runs.get("preemption"))
    (step, p), = [(s.index, p) for s in run.steps for p in s.scheduler.preempted]
    assert p.req_id == "r2"
    ex = explain(run, request="r2")
    assert _causes_at(ex, step, "preempt") == {"victim_self"}
    assert f"allocating for {p.while_allocating_for}" in _lines_at(ex, step, "preempt")[0].text()
    back = next(s.index for s in run.steps for r in s.scheduler.scheduled if r.req_id == "r2" and r.kind == "resumed")
    for n in range(step + 1, back):
        assert _causes_at(ex, n, "wait") == {"kv_blocks"}, n
    assert _causes_at(ex, back, "resume") == {"resumed"}
    assert "evicted" in _causes_at(ex, back, "cache")
    evicted = next(ln for ln in ex.lines if ln.cause == "evicted")
    s = run.step(evicted.params["step"])
    assert evicted.params["block"] in s.kv.evicted and evicted.params["block"] in s.kv.allocated[evicted.params["by"]]


# --- the prefix cache: why not more -------------------------------------------------------------------------------


def test_cache_partial_block_only():
    # shared_prefix: second hits both full blocks of the shared prefix; only its partial last block misses.
    ex = explain(_run("shared_prefix"), request="second")
    assert _causes_at(ex, 3, "cache") == {"hit", "partial_block"}
    hit = next(ln for ln in ex.lines if ln.cause == "hit")
    assert (hit.params["hit"], hit.params["cacheable"]) == (64, 64)


def test_cache_miss_evicted_names_step_and_request():
    # cmp_evict: w shares x's two blocks, but x's second block was evicted at step 4 to make room for z.
    run = _run(PROOFS + "cmp_evict")
    ex = explain(run, request="w")
    assert _causes_at(ex, 7, "cache") == {"hit", "evicted", "partial_block"}
    ln = next(ln for ln in ex.lines if ln.cause == "evicted")
    assert (ln.params["owner"], ln.params["step"], ln.params["by"]) == ("x", 4, "z")
    assert ln.params["block"] in run.step(4).kv.evicted


def test_cache_miss_never_computed():
    ex = explain(_run("preemption"), request="r0")
    assert _causes_at(ex, 1, "cache") == {"no_hit", "never_computed", "partial_block"}


def test_cache_off():
    run = _run(PROOFS + "proof_no_prefix_cache")
    ex = explain(run, cache=True)
    assert {c for row in ex.table for c in row["causes"]} == {"cache_off"}
    assert [row["hit_tokens"] for row in ex.table] == [0, 0, 0, 0]


def test_cache_table_rows_per_admission():
    ex = explain(_run("preemption"), cache=True)
    rows = [(r["request"], r["step"], r["kind"], r["hit_tokens"]) for r in ex.table]
    assert rows == [("r0", 1, "new", 0), ("r1", 1, "new", 0), ("r2", 1, "new", 0), ("r2", 61, "resumed", 32)]
    assert ex.table[-1]["causes"] == ["evicted", "partial_block"]


# --- chunked prefill: each chunk's size and why ---------------------------------------------------------------------


def test_chunk_cut_to_the_budget_left():
    run = _run("chunked_prefill")
    ex = explain(run, request="long")
    ln = _lines_at(ex, 2, "chunk")[0]
    assert ln.cause == "chunk_budget"
    assert "32 - 1 (to short 1) = 31" in ln.text()
    assert _causes_at(ex, 4, "chunk") == {"last_chunk"}


# --- a step --------------------------------------------------------------------------------------------------------


def test_step_view_budget_and_waits():
    run = _run(PROOFS + "proof_admission")
    ex = explain(run, step=3)
    sch = run.step(3).scheduler
    budget = ex.lines[0]
    assert budget.params["left"] == sch.token_budget - sch.tokens_scheduled
    waits = {ln.who: ln.cause for ln in ex.lines if ln.topic == "wait"}
    assert waits == {"b": "kv_blocks", "d": "head_of_line"}


# --- right or silent -------------------------------------------------------------------------------------------------


def _edited_copy(tmp_path, name, step, kind, **fields):
    """A copy of a golden whose record of `kind` at `step` has `fields` changed: records the rules cannot explain."""
    src = _run(name).path
    dst = tmp_path / name.replace("/", "_")
    shutil.copytree(src, dst)
    f = dst / "records.0.jsonl"
    lines = []
    for line in f.read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] == step and rec["kind"] == kind:
            rec.update(fields)
        lines.append(json.dumps(rec))
    f.write_text("\n".join(lines) + "\n")
    return load_run(dst)


def test_silent_when_the_queues_do_not_match(tmp_path):
    run = _edited_copy(tmp_path, "preemption", 45, "scheduler", waiting_before=2)
    ex = explain(run, request="r2")
    assert _causes_at(ex, 45, "wait") == {"unknown"}
    assert _causes_at(ex, 44, "wait") == {"kv_blocks"}  # the other steps keep their cause


def test_silent_when_the_numbers_contradict_the_rule(tmp_path):
    run = _edited_copy(tmp_path, "preemption", 45, "kv", free_blocks=5)  # 3 blocks would have fit
    ex = explain(run, request="r2")
    assert _causes_at(ex, 45, "wait") == {"unknown"}
    assert "5 were free" in _lines_at(ex, 45, "wait")[0].text()


def test_level_steps_says_what_needs_blocks(trace_runs):
    run = load_run(trace_runs.get("preemption", level="steps"))
    ex = explain(run, request="r2")
    waits = [ln for ln in ex.lines if ln.topic == "wait"]
    assert waits and {ln.key for ln in waits} == {"wait_kv_nolevel"}  # the cause, without invented numbers
    assert not any(ln.cause in ("evicted", "never_computed") for ln in ex.lines)
    levels = [ln for ln in ex.lines if ln.topic == "level"]
    assert len(levels) == 1 and "--level blocks" in levels[0].text()


# --- languages, the command, show -------------------------------------------------------------------------------------


def test_every_message_has_en_and_zh_with_the_same_fields():
    for key, texts in MSG.items():
        assert set(texts) == {"en", "zh"}, key
        names = [{f for _, f, _, _ in string.Formatter().parse(t) if f} for t in texts.values()]
        assert names[0] == names[1], key


def test_zh_names_the_same_causes():
    run = _run(PROOFS + "cmp_preempt")
    en, zh = explain(run, request="c").to_json("en"), explain(run, request="c").to_json("zh")
    assert [ln["cause"] for ln in en["lines"]] == [ln["cause"] for ln in zh["lines"]]
    assert all(re.search(r"[\u4e00-\u9fff]", ln["text"]) for ln in zh["lines"])


def test_cli_explain_preemption_golden(cli):
    r = cli("explain", "traces/golden/preemption", "--request", "r2")
    assert r.returncode == 0, r.stderr
    assert "preempted while allocating for r2" in r.stdout and "It lost 64 computed tokens" in r.stdout
    assert "evicted at step 39 to make room for r1" in r.stdout and "sched-preempt-self" in r.stdout
    j = cli("explain", "traces/golden/preemption", "--step", "38", "--json")
    data = json.loads(j.stdout)
    assert data["subject"] == "step 38" and [ln["cause"] for ln in data["lines"] if ln["topic"] == "preempt"] == ["victim_self"]


@pytest.mark.parametrize("kw, says", [
    ({"request": "r9"}, "no request 'r9'"),
    ({"step": 999}, "has no step 999"),
    ({}, "give exactly one of"),
    ({"request": "r2", "cache": True}, "give exactly one of"),
])
def test_bad_input_is_a_tour_error(kw, says):
    with pytest.raises(TourError, match=re.escape(says)):
        explain(_run("preemption"), **kw)


@pytest.mark.parametrize("args, says", [
    (("no-such-run", "--cache"), "no run directory"),
    (("traces/golden/preemption", "--request", "r9"), "no request 'r9'"),
    (("traces/golden/preemption", "--cache", "--lang", "fr"), "--lang 'fr'"),
])
def test_cli_bad_input_one_line_exit_2(cli, args, says):
    r = cli("explain", *args)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and says in r.stderr, r.stderr


def test_show_request_prints_the_summary():
    from rich.console import Console

    from vllm_tour.views.show import request_view

    console = Console(width=200, record=True)
    console.print(request_view(_run("preemption"), "r2"))
    out = console.export_text()
    assert "why (vllm-tour explain --request r2" in out
    assert "preempted while allocating for r2" in out and "waited: not enough free KV blocks" in out


def test_every_note_it_cites_exists_and_holds_on_the_pin():
    """A rule is cited by note id: each id must be a note, and hold on v0.32.0 (the goldens' pin)."""
    import inspect

    from vllm_tour.views import explain as module
    from vllm_tour.views.explain import note_marks

    cited = set(re.findall(r'"((?:sched|kvm|pool|fe|core)-[a-z0-9-]+)"', inspect.getsource(module)))
    marks = note_marks("v0.32.0")
    assert cited and {n: marks.get(n, "missing") for n in cited if marks.get(n) != ""} == {}


def test_readme_shows_what_explain_prints():
    """README's explain example is this command's output on the golden (cut at "..."), not a paraphrase."""
    from rich.console import Console

    from vllm_tour.paths import REPO_ROOT
    from vllm_tour.views.explain import render

    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("$ vllm-tour explain traces/golden/preemption --request r2\n", 1)[1].split("```", 1)[0]
    console = Console(width=120, record=True)
    render(explain(_run("preemption"), request="r2"), console)
    out = " ".join(console.export_text().split())
    # README keeps some sentences and leaves out others (and most evidence lines): each sentence it shows must be
    # printed, in README's order; a sentence starts at "step"/"steps"/"arrived"/"explain"/an evidence line.
    entries = [" ".join(e.split()) for e in re.split(r"\n(?=explain |arrived |steps? \d|    fields |\.\.\.)", block)]
    entries = [e for e in entries if e and e != "..."]
    assert len(entries) >= 8
    at = 0
    for e in entries:
        found = out.find(e, at)
        assert found >= 0, e
        at = found + len(e)


# --- every pin: rules that differ between releases come from the pin profile -------------------------------------


def _alloc_at(ex, step):
    (ln,) = _lines_at(ex, step, "alloc")
    return ln


def test_the_free_queue_rule_is_the_pins_own():
    """r2 resumes at step 61 on both releases and gets other blocks: v0.21.0 appended every freed block to the free
    queue, v0.32.0 put hashless ones in front (pins/*.toml free_queue_policy). Each explanation names its own pin's
    rule, and the records fit that rule and not the other one."""
    from vllm_tour.views import free_queue
    from vllm_tour.views.explain import _Explainer

    seen = {}
    for name, policy in (("preemption", "uncached_to_front"), ("v0.21.0/preemption", "append_all")):
        run = _run(name)
        ln = _alloc_at(explain(run, request="r2"), 61)
        assert ln.cause == f"free_queue_{policy}"
        assert ln.params["blocks"] == run.step(61).kv.allocated["r2"]
        assert f"free_queue_policy = {policy}, pins/{run.meta.pin}.toml" in ln.text()
        assert ("pool-free-order" in ln.notes) == (policy == "uncached_to_front")  # that note is not on v0.21.0
        other = next(p for p in free_queue.POLICIES if p != policy)
        ex = _Explainer(run)
        assert free_queue.rebuild(run, other, ex._cache.hashed)[(61, "r2")].expected != ln.params["blocks"]
        seen[run.meta.pin] = ln.params["blocks"]
    assert seen["v0.21.0"] != seen["v0.32.0"]
    # the eviction both releases record at step 39 cites the notes of each pin's own rule
    evicted = [next(ln for ln in explain(_run(n), request="r2").lines if ln.cause == "evicted") for n in ("preemption", "v0.21.0/preemption")]
    assert "pool-free-order" in evicted[0].notes and "pool-free-order" not in evicted[1].notes


def test_every_golden_allocation_fits_its_pins_free_queue_rule():
    """The rebuilt free queue is a model of upstream's: on every golden of both releases each recorded
    allocation is its head (where one is not, explain says it cannot tell -- this keeps that rare)."""
    from vllm_tour.paths import REPO_ROOT
    from vllm_tour.views.explain import _Explainer

    runs = sorted(p.parent for p in (REPO_ROOT / "traces" / "golden").rglob("meta.json"))
    checked = 0
    for d in runs:
        ex = _Explainer(load_run(d))
        assert ex.free_policy in ("append_all", "uncached_to_front"), d
        for a in ex.allocs.values():
            assert a.expected == a.blocks, (d.name, a)
            checked += 1
    assert checked > 100


def _with_pin(tmp_path, name, pin):
    dst = tmp_path / "run"
    shutil.copytree(_run(name).path, dst)
    meta = json.loads((dst / "meta.json").read_text())
    meta["pin"] = pin
    (dst / "meta.json").write_text(json.dumps(meta))
    return load_run(dst)


def test_a_pin_without_the_fact_says_it_does_not_know(tmp_path, monkeypatch):
    from vllm_tour.paths import REPO_ROOT
    from vllm_tour.upstream import pins

    # no pin file at all (a run recorded on a pin since removed)
    ln = _alloc_at(explain(_with_pin(tmp_path / "a", "v0.21.0/preemption", "v0.20.0"), request="r2"), 61)
    assert ln.cause == "policy_unknown" and "there is no pin file pins/v0.20.0.toml" in ln.text()
    # a pin file whose profile does not state the policy: the profile's default is not taken for a fact
    text = (REPO_ROOT / "pins" / "v0.21.0.toml").read_text().replace('tag = "v0.21.0"', 'tag = "v0.20.0"', 1)
    (tmp_path / "pins").mkdir()
    (tmp_path / "pins" / "v0.20.0.toml").write_text("\n".join(x for x in text.splitlines() if not x.startswith("free_queue_policy")))
    monkeypatch.setattr(pins, "PINS_DIR", tmp_path / "pins")
    pins.pin_profile.cache_clear()
    try:
        assert pins.pin_profile("v0.20.0").free_queue_policy == "uncached_to_front"  # the default is there...
        ex = explain(_with_pin(tmp_path / "b", "v0.21.0/preemption", "v0.20.0"), request="r2")
    finally:
        pins.pin_profile.cache_clear()
    ln = _alloc_at(ex, 61)  # ... and not used
    assert ln.cause == "policy_unknown" and "pins/v0.20.0.toml [profile] gives no free_queue_policy" in ln.text()
    evicted = next(ln for ln in ex.lines if ln.cause == "evicted")
    assert evicted.notes == ["pool-evict-on-reuse"]  # the eviction is recorded; no rule is cited for the order


# --- the site's trace pages carry it --------------------------------------------------------------------------------


def test_site_trace_page_carries_each_requests_explanation(cli):
    """Each request of a golden has its turns on the trace page, in both languages, the same sentences `explain
    --json` gives scripts, each rule linked to its note."""
    import html

    from vllm_tour.site.traces import trace_page

    run = _run("preemption")
    _, page = trace_page(run, run.meta.pin, lambda nid: f"../notes.html#note-{nid}")
    why = page.split('<section id="why">', 1)[1]
    li = re.compile(r'<li data-cause="([^"]*)"><span class="i18n " lang="en">(.*?)</span><span class="i18n " lang="zh">(.*?)</span>(.*?)</li>')
    for rid in run.request_ids():
        items = li.findall(why.split(f'<h3 id="why-{rid}">', 1)[1].split("</ul>", 1)[0])
        by_lang = {lang: explain(run, request=rid).to_json(lang)["lines"] for lang in ("en", "zh")}
        if rid == "r2":  # what a script gets from the command itself
            r = cli("explain", "traces/golden/preemption", "--request", rid, "--json")
            assert json.loads(r.stdout)["lines"] == by_lang["en"]
        expected = [i for i, ln in enumerate(by_lang["en"]) if ln["topic"] in ("wait", "preempt", "resume", "cache", "finish", "level")
                    and ln["cause"] not in ("no_hit", None)]
        assert [c for c, *_ in items] == [by_lang["en"][i]["cause"] for i in expected], rid
        for (cause, en, zh, rules), i in zip(items, expected):
            assert html.unescape(en).endswith(by_lang["en"][i]["text"]) and html.unescape(zh).endswith(by_lang["zh"][i]["text"])
            for note in by_lang["en"][i]["notes"]:
                assert f'href="../notes.html#note-{note}"' in rules
    assert 'data-cause="victim_self"' in why.split('<h3 id="why-r2">')[1]  # r2's preemption is among its turns
