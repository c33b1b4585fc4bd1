"""Speculative decoding's notes proven (issue 35 item 3) and explained (item 1): the checks in
notes/proofs/spec_decode.py on the recorded ngram runs (traces/golden/proofs/v0.32.0/spec_*), each made to fail by
a trace that contradicts it, one made to fail by changing upstream's own rule in a live run, and `explain` saying
per step how many drafts were proposed and accepted and why the first rejected one was rejected.

The live runs come from the compare cache (`upstream_run`, shared with tests/test_spec_decode.py); the mutant run is
an engine of its own, in a subprocess whose spawned engine child is patched at import (a sitecustomize on its
PYTHONPATH): upstream runs ngram speculation in a spawned process (engine.run._drive_in_child), which a monkeypatch
in this process would not reach.
"""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_tour.notes import proofs, verify
from vllm_tour.paths import REPO_ROOT, SCENARIOS_DIR
from vllm_tour.trace.reader import load_run
from vllm_tour.views.explain import explain

PIN = "v0.32.0"
SPEC_NOTES = {"spec-ngram-match", "spec-greedy-accept", "spec-scheduled-drafts", "spec-rejection-rollback",
              "spec-lookahead-slots", "spec-preempt-drops-drafts", "sched-append-and-stop"}


def _recorded(name):
    return load_run(verify.recorded_run(PIN, name))


@pytest.fixture(scope="module")
def ngram_run(upstream_run):
    return load_run(upstream_run("spec_ngram").run_dir)


def test_the_spec_notes_are_proven_on_each_recorded_release_and_held_to_no_other():
    """v0.32.0 and v0.31.0 ran both spec scenarios (v0.31.0 in its environment), v0.21.0 on the H200: a claim is
    held to a release exactly where its scenario's run is kept."""
    table = verify.proofs_for_pin(PIN)
    assert SPEC_NOTES <= table.keys()
    for note in SPEC_NOTES:
        p = table[note]
        for pin in ("v0.32.0", "v0.31.0", "v0.21.0"):
            kept = verify.recorded_run(pin, p.scenario).exists()
            assert (pin in p.only_on) == kept, (note, pin)
            if kept:
                v = verify.check_claims(load_run(verify.recorded_run(pin, p.scenario)), p.scenario, [note], table)[0]
                assert v.holds and len(v.requires) >= 2, (note, pin, v.evidence, v.requires)
            assert (note in verify.proofs_for_pin(pin)) == kept, (note, pin)


def test_the_checks_require_the_cases_the_brief_names():
    """Each check declares the events its run must show, read from its code (proofs/requirements.py)."""
    from vllm_tour.notes.proofs.requirements import requirements

    needs = {name: requirements(verify.CHECKS[name]) for name in verify.CHECKS if verify.CHECKS[name].__module__.endswith("spec_decode")}
    assert "the run never shows a draft rejected after an accepted one" in needs["greedy_keeps_drafts_to_first_mismatch"]
    assert "the run never shows every draft of a step accepted (a bonus token added)" in needs["greedy_keeps_drafts_to_first_mismatch"]
    assert "the run never shows a request preempted while holding drafts" in needs["preempted_drafts_dropped"]
    assert "the run never shows a step that yielded more tokens than the request had left" in needs["step_tokens_cut_at_stop"]
    assert "the run never shows a proposal where a later occurrence would draft other tokens" in \
        needs["ngram_drafts_from_longest_earliest_match"]
    assert all(n[0] == "the run enables no ngram speculative decoding" for n in needs.values())


def _verification(run, step, req):
    return next(v for v in run.step(step).spec_verify.requests if v.req_id == req)


def _accept_one_more(run):
    """The first rejected draft of step 11 (abc: [115, 148], 1 accepted) recorded as accepted, with the same tokens."""
    _verification(run, 11, "abc").num_accepted = 2


def _rejected_draft_kept(run):
    """The target's token at the rejected draft made equal to that draft (step 4: rep, draft 259 vs 236)."""
    _verification(run, 4, "rep").sampled_token_ids = [259]


def _verified_twice(run):
    run.step(5).spec_verify = copy.deepcopy(run.step(4).spec_verify)


def _not_rolled_back(run):
    next(e for e in run.step(7).scheduler.scheduled if e.req_id == "c").num_computed_tokens += 1


def _other_drafts(run):
    run.step(8).spec_proposal.proposed["c"] = [268, 152, 28]  # the latest occurrence's tokens, not the earliest's


def _lookahead(run):
    run.step(6).spec_verify.num_lookahead_tokens = 3


def _verified_after_preemption(run):
    run.step(21).spec_verify.requests.append(copy.deepcopy(_verification(run, 21, "a")).model_copy(update={"req_id": "b"}))


def _nothing_trimmed(run):
    next(o for o in run.outputs.requests if o.req_id == "rep").token_ids.extend([209, 457])


MUTATIONS = {
    "greedy_keeps_drafts_to_first_mismatch": [("spec_ngram", _accept_one_more), ("spec_ngram", _rejected_draft_kept)],
    "drafts_verified_next_step": [("spec_ngram", _verified_twice)],
    "rejected_drafts_rolled_back": [("spec_preempt", _not_rolled_back)],
    "ngram_drafts_from_longest_earliest_match": [("spec_preempt", _other_drafts)],
    "ngram_lookahead_is_zero": [("spec_preempt", _lookahead)],
    "preempted_drafts_dropped": [("spec_preempt", _verified_after_preemption)],
    "step_tokens_cut_at_stop": [("spec_ngram", _nothing_trimmed)],
}


@pytest.mark.parametrize("check, scenario, mutate", [(c, s, m) for c, ms in MUTATIONS.items() for s, m in ms],
                         ids=lambda x: getattr(x, "__name__", x))
def test_a_spec_check_fails_when_the_trace_contradicts_it(check, scenario, mutate):
    run = _recorded(scenario)
    assert verify.CHECKS[check](run)
    bad = copy.deepcopy(run)
    mutate(bad)
    with pytest.raises(proofs.ClaimFailed) as e:
        verify.CHECKS[check](bad)
    assert e.value.step is not None, e.value.evidence


# The proposer's rule changed at its source: `prev_lps >= longest_ngram` keeps the earliest occurrence of the longest
# match; `>` keeps the latest. The KMP function is recompiled from upstream's own text with that one change.
MUTANT = textwrap.dedent('''
    import importlib.machinery, inspect, os, sys

    TARGET = "vllm.v1.spec_decode.ngram_proposer"
    RULE, MUTANT = "if prev_lps >= longest_ngram:", "if prev_lps > longest_ngram:"

    def _mutate(module):
        import numba
        fn = module._find_longest_matched_ngram_and_propose_tokens
        src = inspect.getsource(fn.py_func)
        assert RULE in src, "upstream's match rule moved"
        src = src[src.index("def "):].replace(RULE, MUTANT)
        ns = dict(vars(module))
        exec(compile(src, module.__file__, "exec"), ns)
        module._find_longest_matched_ngram_and_propose_tokens = numba.njit(ns[fn.__name__])
        open(os.path.join(os.environ["SPEC_MUTANT_MARK"], f"mutated.{os.getpid()}"), "w").close()

    class _Hook:
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                _mutate(module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
''')


def test_the_ngram_check_goes_red_when_upstreams_match_rule_is_changed(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(MUTANT, encoding="utf-8")
    table = verify.proofs_for_pin(PIN)
    proof = table["spec-ngram-match"]
    out = tmp_path / "mutant"
    script = tmp_path / "run_mutant.py"
    script.write_text("from vllm_tour.engine.run import run_upstream\nfrom vllm_tour.scenario import load_scenario\n\n"
                      "if __name__ == '__main__':\n"
                      f"    run_upstream(load_scenario({str(SCENARIOS_DIR / (proof.scenario + '.toml'))!r}), "
                      f"run_dir={str(out)!r}, level='blocks')\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO_ROOT)]), "SPEC_MUTANT_MARK": str(tmp_path)}
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert list(tmp_path.glob("mutated.*")), "the mutant rule was never installed"
    v = verify.check_claims(load_run(out), proof.scenario, ["spec-ngram-match"], table)[0]
    assert not v.holds and v.step is not None and "prompt lookup drafts" in v.evidence, v.evidence


# --- explain: drafts proposed, accepted, and why the first rejected one was rejected ----------------------------


def test_explain_says_per_step_drafts_accepted_and_why_the_first_was_rejected(ngram_run):
    """On this machine's spec_ngram run: every verification of a request is one line naming its drafts, the number
    accepted and, at a rejection, the target's token against the draft -- all read from the spec_verify record."""
    for rid in ("rep", "abc"):
        ex = explain(ngram_run, request=rid)
        lines = {ln.steps[0]: ln for ln in ex.lines if ln.topic == "spec" and ln.key != "spec_cut"}
        verified = {s.index: v for s in ngram_run.steps if s.spec_verify for v in s.spec_verify.requests if v.req_id == rid}
        assert lines.keys() == verified.keys() and verified
        for n, v in verified.items():
            text, d, got, a = lines[n].text("en"), v.draft_token_ids, v.sampled_token_ids, v.num_accepted
            assert f"the {len(d)} drafts proposed after step {n - 1} ({d})" in text
            if a == len(d):
                assert lines[n].cause == "spec_all_accepted" and f"bonus token {got[-1]}" in text
            else:
                assert lines[n].cause == "spec_rejected_greedy" and f"{a} accepted; draft {a + 1} was rejected" in text
                assert f"the target's token at its position was {got[a]}, not the draft {d[a]}" in text
            assert "spec-greedy-accept" in lines[n].notes and "spec-random-accept" not in lines[n].notes


def test_explain_spec_on_the_recorded_run_in_both_languages(cli):
    r = cli("explain", PROOFS_NGRAM, "--request", "rep", "--json")
    assert r.returncode == 0, r.stderr
    spec = [ln for ln in json.loads(r.stdout)["lines"] if ln["topic"] == "spec"]
    assert [(ln["steps"][0], ln["cause"]) for ln in spec] == [
        (4, "spec_rejected_greedy"), (11, "spec_rejected_greedy"), (15, "spec_all_accepted"), (15, "spec_cut")]
    assert "draft 1 was rejected because the target's token at its position was 236, not the draft 259" in spec[0]["text"]
    assert "only 2 were appended" in spec[3]["text"] and "sched-append-and-stop" in spec[3]["notes"]
    zh = cli("explain", PROOFS_NGRAM, "--request", "rep", "--json", "--lang", "zh")
    texts = [ln["text"] for ln in json.loads(zh.stdout)["lines"] if ln["topic"] == "spec"]
    assert "目标模型在该位置的 token 是 236，而不是草稿 token 259" in texts[0]


PROOFS_NGRAM = "traces/golden/proofs/v0.32.0/spec_ngram"


def test_explain_names_drafts_dropped_by_a_preemption_and_sampled_rejections():
    ex = explain(_recorded("spec_preempt"), request="b")
    dropped = [ln for ln in ex.lines if ln.cause == "spec_dropped"]
    assert [ln.steps[0] for ln in dropped] == [21, 23] and "[280, 418, 103]" in dropped[0].text("en")
    sampled = load_run(REPO_ROOT / "traces" / "golden" / "proofs" / PIN / "spec_ngram")
    sampled = copy.deepcopy(sampled)
    for r in sampled.meta.requests:
        r.temperature = 0.8
    ln = next(ln for ln in explain(sampled, request="rep").lines if ln.topic == "spec")
    assert ln.cause == "spec_rejected_sampled" and "draft 1 (259) failed the accept test" in ln.text("en")
    assert "236 was drawn there" in ln.text("en") and "spec-random-accept" in ln.notes
