"""`vllm-tour annotations verify`: notes' claims checked on live upstream runs (cached per scenario,
shared with the compare tests), a planted false claim caught, bad input refused."""

import json
import re

import pytest
from typer.testing import CliRunner

from vllm_tour.cli import app
from vllm_tour.compare.upstream import upstream_run_for
from vllm_tour.paths import SCENARIOS_DIR
from vllm_tour.scenario import load_scenario
from vllm_tour.notes import proofs, verify
from vllm_tour.notes.annotations import all_notes, load_all
from vllm_tour.trace.reader import load_run

PIN = "v0.32.0"
# Notes on these behaviours must carry a proof (ordering notes are listed by id below).
PROVEN_CONCEPTS = {"eviction", "preemption", "prefix-hit", "chunked-prefill"}
ORDERING_NOTES = {"sched-queues", "sched-running-loop", "sched-fcfs-queue", "sched-admit", "sched-preempt-prepend",
                  "sched-budget-init", "kvm-free-reverse", "pool-free-order", "pool-free-queue", "pool-get-new"}


@pytest.fixture(scope="module")
def report(cli):
    r = cli("annotations", "verify", "--pin", PIN, "--json", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout)


def test_every_claim_holds_on_the_live_engine(report):
    assert report["failed"] == 0
    assert report["proven"] >= 25
    assert all(c["holds"] and c["evidence"] for c in report["claims"])


# Notes on these behaviours that the CPU pin's live engine cannot show, and why (each is a gap, not a pass).
NOT_PROVABLE_HERE = {
    "async-cache-lags": "async scheduling is forced off on the CPU platform; the engine never runs AsyncScheduler",
    "fe-none-hash-seed": "the trace records no block hash values, so equal hashes across runs cannot be read from it",
}


def test_notes_on_ordering_eviction_preemption_prefix_hits_and_chunking_are_proven(report):
    proven = {c["note"] for c in report["claims"]}
    notes = all_notes(load_all())
    shown = [n for n in notes if n.status_on(PIN) in ("applies", "variant")]  # a note hidden on the pin claims nothing
    must = {n.id for n in shown if PROVEN_CONCEPTS & set(n.concepts)} | (ORDERING_NOTES & {n.id for n in shown})
    assert set(NOT_PROVABLE_HERE) <= must and not set(NOT_PROVABLE_HERE) & proven
    assert not must - proven - set(NOT_PROVABLE_HERE), f"notes without a proof: {sorted(must - proven - set(NOT_PROVABLE_HERE))}"


def never_used_blocks_first(run):
    """The FALSE claim (v0.21.0's order): an allocation hands out never-used blocks before any freed block."""
    used: set[int] = set()
    for s in run.steps:
        for req, blocks in (s.kv.allocated.items() if s.kv else ()):
            fresh = [b for b in blocks if b not in used]
            if fresh and blocks[:len(fresh)] != fresh:
                raise proofs.ClaimFailed(s.index, f"{req} got {blocks}: freed blocks "
                                                  f"{[b for b in blocks if b in used]} before never-used {fresh}")
            used.update(blocks)
    return "never-used blocks first in every allocation"


def test_a_false_claim_fails_with_note_step_and_evidence(tmp_path, monkeypatch):
    monkeypatch.setitem(verify.CHECKS, "never_used_blocks_first", never_used_blocks_first)
    planted = tmp_path / "proofs.toml"
    planted.write_text('[pool-free-order]\nscenario = "cmp_evict"\ncheck = "never_used_blocks_first"\n'
                       'claim.en = "Never-used blocks are handed out before freed ones."\n'
                       'claim.zh = "从未用过的块先于已释放的块分出。"\n', encoding="utf-8")
    r = CliRunner().invoke(app, ["annotations", "verify", "--pin", PIN, "--proofs", str(planted)],
                           env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("claim fails"))
    m = re.search(r"claim fails pool-free-order on cmp_evict, step (\d+): (\w+) got \[([\d, ]+)\]: freed blocks", line)
    assert m, line
    # The evidence is the trace's: that request's allocation in that step, freed blocks first.
    traced = load_run(upstream_run_for(load_scenario(SCENARIOS_DIR / "cmp_evict.toml"))).step(int(m[1]))
    assert traced.kv.allocated[m[2]] == [int(b) for b in m[3].split(", ")]


def test_the_true_claim_on_the_same_run_holds():
    """The proof of the real order passes where the planted one failed (same scenario, one check)."""
    r = CliRunner().invoke(app, ["annotations", "verify", "--pin", PIN, "--note", "pool-free-order", "--json"])
    assert r.exit_code == 0, r.output
    claim = json.loads(r.output[r.output.index("{"):])["claims"]
    assert [c["note"] for c in claim] == ["pool-free-order"] and "freed without a hash" in claim[0]["evidence"]


@pytest.mark.parametrize("args, toml, message", [
    (["--note", "no-such-note"], None, "no proof for note(s) no-such-note"),
    (["--pin", "v0.21.0"], None, "pin v0.21.0 is not installed here"),
    (["--pin", "v9.9.9"], None, "no pin 'v9.9.9'"),
    ([], '[pool-free-order\nscenario = "cmp_evict"', "not valid TOML"),
    ([], '[no-such-note]\nscenario = "cmp_evict"\ncheck = "owed_tokens"\nclaim.en = "x"\nclaim.zh = "x"\n',
     "no note with id 'no-such-note'"),
    ([], '[pool-free-order]\nscenario = "no_such_scenario"\ncheck = "owed_tokens"\nclaim.en = "x"\nclaim.zh = "x"\n',
     "no scenario 'no_such_scenario'"),
    ([], '[pool-free-order]\nscenario = "cmp_evict"\ncheck = "no_such_check"\nclaim.en = "x"\nclaim.zh = "x"\n',
     "no check 'no_such_check'"),
    ([], '[pool-free-order]\nscenario = "cmp_evict"\ncheck = "owed_tokens"\nclaim.en = "x"\n', "missing claim language"),
])
def test_bad_input_is_one_line_and_exit_2(cli, tmp_path, args, toml, message):
    if toml is not None:
        (tmp_path / "p.toml").write_text(toml, encoding="utf-8")
        args = [*args, "--proofs", str(tmp_path / "p.toml")]
    r = cli("annotations", "verify", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert "upstream run of" not in r.stdout + r.stderr  # refused before any engine starts


# Each mutation breaks, in a copy of the real trace, the behaviour one check proves: the check must then fail.
def _swap_first_two(xs):
    xs[0], xs[1] = xs[1], xs[0]


MUTATIONS = {
    "hashless_before_fresh_before_cached": ("cmp_evict", lambda run: run.step(4).kv.allocated["z"].reverse()),
    "cached_evicted_in_free_order": ("cmp_evict", lambda run: run.step(8).kv.evicted.reverse()),
    "evicted_when_handed_out": ("cmp_evict", lambda run: run.step(5).kv.evicted.append(1)),
    "running_in_admission_order": ("cmp_chunked", lambda run: _swap_first_two(run.step(6).scheduler.scheduled)),
    "victim_is_last_admitted": ("cmp_preempt", lambda run: setattr(run.step(26).scheduler.preempted[0], "req_id", "a")),
    "same_step_hit": ("proof_same_step", lambda run: run.step(1).kv.allocated.pop("x")),
    "partial_prefill_sample_dropped_by_runner": (
        "cmp_chunked", lambda run: run.step(1).runner[0].sampled_token_ids.__setitem__("long1", [7])),
    "watermark_off": ("proof_admission", lambda run: setattr(run.step(5).kv, "free_blocks", 27)),
    "whole_prompt_must_fit": ("proof_admission", lambda run: [setattr(run.step(i).kv, "free_blocks", 64) for i in (2, 3, 4)]),
}


@pytest.fixture(scope="module")
def traced():
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = load_run(upstream_run_for(load_scenario(SCENARIOS_DIR / f"{name}.toml")))
        return runs[name]

    return get


@pytest.mark.parametrize("check", sorted(MUTATIONS))
def test_a_check_fails_when_the_trace_contradicts_it(traced, check):
    import copy

    scenario, mutate = MUTATIONS[check]
    assert verify.CHECKS[check](traced(scenario))  # holds on the real trace
    run = copy.deepcopy(traced(scenario))
    mutate(run)
    with pytest.raises(proofs.ClaimFailed):
        verify.CHECKS[check](run)


@pytest.mark.parametrize("pin", ["v0.32.0", "v0.31.0", "v0.21.0"])
def test_every_claim_holds_on_the_recorded_runs_the_site_links(pin):
    """`verify --record` keeps the runs the claims were proven on (traces/golden/proofs/PIN/, no tensors): the
    site links each proven note to its run, so the claim must hold on that checked-in run too. v0.31.0's were
    recorded in its environment (`verify --pin v0.31.0 --record`), v0.21.0's by the GPU runner on the H200."""
    table = verify.proofs_for_pin(pin)
    assert len(table) >= 50
    for name, note_ids in verify._by_scenario(table).items():
        run = load_run(verify.recorded_run(pin, name))
        assert run.meta.pin == pin and run.finished, name
        failed = [v for v in verify.check_claims(run, name, note_ids, table) if not v.holds]
        assert not failed, [(v.note, v.step, v.evidence) for v in failed]


def test_another_release_keeps_the_default_claims_only_where_its_notes_say_the_same():
    """v0.21.0 is held to v0.32.0's claims on notes with the same text there; notes with their own v0.21.0 text
    take their claim from annotations/proofs/v0.21.0.toml; notes hidden on v0.21.0 have none."""
    default, old = verify.proofs_for_pin(PIN), verify.proofs_for_pin("v0.21.0")
    notes = {n.id: n for n in all_notes(load_all())}
    for note_id, proof in old.items():
        if "v0.21.0" in notes[note_id].variant:
            assert proof.claim != default[note_id].claim, note_id
        assert "v0.21.0" not in notes[note_id].not_on, note_id
    assert {"pool-get-new", "pool-free-queue"} <= old.keys() and "pool-free-order" not in old  # not_on v0.21.0
    assert old["pool-touch"].scenario == "proof_evict_tail" and old["pool-touch"].claim == default["pool-touch"].claim


def test_the_free_queue_checks_tell_the_two_releases_apart():
    """On the same scenario, v0.32.0 hands out hashless freed blocks before never-used ones and v0.21.0 never-used
    ones first: each release's check holds on its own run and fails on the other's."""
    runs = {pin: load_run(verify.recorded_run(pin, "cmp_evict")) for pin in ("v0.32.0", "v0.21.0")}
    checks = {"v0.32.0": verify.CHECKS["hashless_before_fresh_before_cached"],
              "v0.21.0": verify.CHECKS["fresh_then_freed_in_free_order"]}
    for pin, check in checks.items():
        assert check(runs[pin])
        other = runs["v0.21.0" if pin == "v0.32.0" else "v0.32.0"]
        with pytest.raises(proofs.ClaimFailed):
            check(other)


def test_recorded_verify_needs_the_kept_run(tmp_path, monkeypatch, cli):
    from vllm_tour.errors import TourError
    from rich.console import Console

    monkeypatch.setattr(verify, "recorded_run", lambda pin, scenario: tmp_path / pin / scenario)
    with pytest.raises(TourError, match="no run of .* recorded on v0.21.0"):
        verify.verify(Console(), "v0.21.0", [], False, None, recorded=True)
    r = cli("annotations", "verify", "--pin", "v0.21.0", "--record", "--recorded")
    assert r.returncode == 2 and r.stderr.strip().endswith("give one of them"), r.stderr


def test_record_keeps_only_runs_whose_claims_all_hold(tmp_path, monkeypatch):
    """`--record` writes the run a scenario's claims were proven on (small, no tensors) and nothing for a
    scenario where a claim fails: a recorded run is evidence, so it is never one that contradicts a note."""
    def planted_false(run):
        raise proofs.ClaimFailed(run.steps[0].index, "planted: this claim never holds")

    monkeypatch.setitem(verify.CHECKS, "planted_false", planted_false)
    monkeypatch.setattr(verify, "recorded_run", lambda pin, scenario: tmp_path / "kept" / pin / scenario)
    planted = tmp_path / "proofs.toml"
    planted.write_text('[pool-free-order]\nscenario = "cmp_evict"\ncheck = "hashless_before_fresh_before_cached"\n'
                       'claim.en = "a"\nclaim.zh = "甲"\n'
                       '[sched-preempt-prepend]\nscenario = "cmp_preempt"\ncheck = "planted_false"\n'
                       'claim.en = "b"\nclaim.zh = "乙"\n', encoding="utf-8")
    r = CliRunner().invoke(app, ["annotations", "verify", "--pin", PIN, "--proofs", str(planted), "--record"],
                           env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert r.exit_code == 1, r.output
    kept = tmp_path / "kept" / PIN
    assert sorted(p.name for p in kept.iterdir()) == ["cmp_evict"]
    run = load_run(kept / "cmp_evict")
    assert run.finished and not list((kept / "cmp_evict").rglob("*.safetensors"))
    verdicts = verify.check_claims(run, "cmp_evict", ["pool-free-order"], verify.load_proofs(planted))
    assert [v.holds for v in verdicts] == [True]


@pytest.mark.parametrize("check, missing", [
    ("running_in_admission_order", "the run never shows a step serving two running requests or more"),
    ("computed_advances_at_schedule", "the run never shows a prefill chunk continued in the next step"),
    ("budget_is_max_num_batched_tokens", "the run sets no max_num_batched_tokens"),
    ("table_covers_scheduled_tokens", "the run never shows a running request's table growing"),
    ("fcfs_admission", "the run never shows a request waiting while an earlier one is admitted"),
])
def test_a_check_fails_naming_the_event_its_run_lacks(check, missing):
    """Issue 34: these four passed on any run. On one request of 16 tokens (golden `single`: one request, no
    chunk, no budget set, no block boundary crossed) each now fails naming what it needed to see."""
    from vllm_tour.notes import proofs
    from vllm_tour.notes.proofs import ClaimFailed
    from vllm_tour.trace.reader import load_run

    fn = next(getattr(m, check) for m in proofs.MODULES if hasattr(m, check))
    with pytest.raises(ClaimFailed, match=missing):
        fn(load_run("single"))
    # and on the run each is proven on, it holds (the golden the site links for chunked prefill)
    if check == "fcfs_admission":
        assert "r4 waiting since step 1 admitted at step 5" in fn(load_run("proofs/v0.32.0/cmp_concurrent"))
    elif check != "running_in_admission_order":
        assert fn(load_run("chunked_prefill"))


# Properties of every step, not events: they hold on any run that records blocks (their requirement is that one
# does) and are checked at every step of it.
EVERY_STEP = {"null_block_never_in_tables", "slot_mapping_from_block_table"}


def test_every_check_declares_what_its_run_must_show_and_fails_naming_it():
    """A check's requirements are read from its own code (proofs/requirements.py): each check has at least one, the
    verify report carries them, and on a run where its case never happens (one request, no pressure: the `single`
    golden) each check fails on the whole run with one of them -- it cannot pass there by having nothing to check."""
    from vllm_tour.notes.proofs.requirements import requirements

    run = load_run("single")
    for name, check in verify.CHECKS.items():
        needs = requirements(check)
        assert needs, f"{name} requires nothing of its run"
        if name in EVERY_STEP:
            assert check(run)
            continue
        with pytest.raises(proofs.ClaimFailed) as e:
            check(run)
        assert e.value.step is None and any(e.value.evidence.startswith(n.split("{…}")[0]) for n in needs), \
            (name, e.value.evidence, needs)
    v = verify.check_claims(run, "single", ["pool-free-order"], verify.proofs_for_pin(PIN))[0]
    assert not v.holds and v.requires == requirements(verify.CHECKS["hashless_before_fresh_before_cached"])


def test_a_check_goes_red_when_upstreams_rule_is_changed(monkeypatch, tmp_path):
    """The mutation is upstream's, not the trace's: v0.32.0's free_blocks puts hashless blocks at the head of the
    free queue through FreeKVCacheBlockQueue.prepend_n; made to append them (the free queue of v0.21.0), a live run
    of the claim's own scenario must fail the claim, naming what the run showed instead."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    from vllm_tour.engine.run import run_upstream

    table = verify.proofs_for_pin(PIN)
    proof = table["pool-free-order"]
    monkeypatch.setattr(FreeKVCacheBlockQueue, "prepend_n", FreeKVCacheBlockQueue.append_n)
    run = load_run(run_upstream(load_scenario(SCENARIOS_DIR / f"{proof.scenario}.toml"), run_dir=tmp_path / "mutant",
                                level="blocks"))
    v = verify.check_claims(run, proof.scenario, ["pool-free-order"], table)[0]
    assert not v.holds and v.step is not None and "hashless" in v.evidence, v.evidence


# --- the serving path: claims on a `vllm-tour serve` run (tests/test_serve.py checks them on its own server's run)

SERVE_MISSING = {
    "n_children_named_after_parent": "the run never shows a request with n > 1",
    "client_close_is_an_engine_abort": "the run never shows a request whose client hung up",
    "aborted_blocks_freed_next_step": "the run never shows an aborted request holding blocks with a step after its abort",
    "front_end_tokens_are_engine_tokens": "the run never shows a request that ended on its own",
    "stop_string_is_an_engine_abort": "the run never shows a request ended by a stop string",
    "aborted_output_dropped": "the run never shows a client-aborted request the engine sampled past",
    "stop_string_ends_a_running_request": "the run never shows a request ended by a stop string with the runner's",
}


def _served_run():
    return load_run(verify.recorded_run(PIN, verify.SERVE))


def test_every_serve_check_is_a_proof_and_fails_on_an_offline_run():
    """An offline run (golden `single`: one request, no server, no abort) has none of the cases: each serving check
    fails naming the event it needed, and holds on the kept serve run."""
    table = verify.proofs_for_pin(PIN)
    assert {p.check for p in table.values() if p.scenario == verify.SERVE} == set(SERVE_MISSING)
    for check, missing in SERVE_MISSING.items():
        with pytest.raises(proofs.ClaimFailed, match=re.escape(missing)):
            verify.CHECKS[check](load_run("single"))
        assert verify.CHECKS[check](_served_run())


def _first(run, **kw):
    return next(r for r in run.server_requests if all(getattr(r, k) == v for k, v in kw.items()))


def _drop_abort_of(run, req_id):
    for s in run.steps:
        s.aborts = [a for a in s.aborts if a.req_id != req_id]


SERVE_MUTATIONS = {  # each contradicts, in a copy of the kept serve run, what one check proves
    "n_children_named_after_parent": lambda run: setattr(_first(run, index=1, n=2), "req_id", "1_someone-else"),
    "client_close_is_an_engine_abort": lambda run: _drop_abort_of(run, _first(run, finish_reason="abort").req_id),
    "aborted_blocks_freed_next_step": lambda run: [s.kv.freed.clear() for s in run.steps if s.kv],
    "front_end_tokens_are_engine_tokens": lambda run: _first(run, finish_reason="length").token_ids.append(7),
    "stop_string_is_an_engine_abort": lambda run: _drop_abort_of(
        run, next(r for r in run.server_requests if isinstance(r.stop_reason, str)).req_id),
    "aborted_output_dropped": lambda run: _first(run, finish_reason="abort").token_ids.insert(0, -1),
    "stop_string_ends_a_running_request": lambda run: [  # the core had finished it: no abort while RUNNING
        setattr(a, "status_before", "FINISHED_STOPPED") for s in run.steps for a in s.aborts
        if a.req_id == next(r for r in run.server_requests if isinstance(r.stop_reason, str)).req_id],
}


@pytest.mark.parametrize("check", sorted(SERVE_MUTATIONS))
def test_a_serve_check_fails_when_the_served_run_contradicts_it(check):
    run = _served_run()
    SERVE_MUTATIONS[check](run)
    with pytest.raises(proofs.ClaimFailed):
        verify.CHECKS[check](run)


def test_output_after_a_stop_string_must_be_dropped_too():
    """serve-drop-after-abort's second case: a stop-string request whose kept tokens are not a prefix of the engine's
    fails the check, and a run without a stop-string request cannot prove it."""
    run = _served_run()
    next(r for r in run.server_requests if isinstance(r.stop_reason, str)).token_ids.insert(0, -1)
    with pytest.raises(proofs.ClaimFailed, match="not a prefix"):
        verify.CHECKS["aborted_output_dropped"](run)
    run = _served_run()
    run.server_requests = [r for r in run.server_requests if not isinstance(r.stop_reason, str)]
    with pytest.raises(proofs.ClaimFailed, match="never shows a stop-string request"):
        verify.CHECKS["aborted_output_dropped"](run)


def test_verify_run_checks_the_serve_claims_on_a_serve_run(cli):
    served = verify.recorded_run(PIN, verify.SERVE)
    r = cli("annotations", "verify", "--run", served, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["failed"] == 0 and {c["note"] for c in report["claims"]} == {
        n for n, p in verify.proofs_for_pin(PIN).items() if p.scenario == verify.SERVE}
    offline = cli("annotations", "verify", "--run", verify.recorded_run(PIN, "cmp_evict"))
    assert offline.returncode == 2 and "is not a `vllm-tour serve` run" in offline.stderr, offline.stderr
    other = cli("annotations", "verify", "--run", served, "--note", "pool-free-order")
    assert other.returncode == 2 and "none of the selected notes" in other.stderr, other.stderr
    both = cli("annotations", "verify", "--run", served, "--recorded")
    assert both.returncode == 2 and both.stderr.count("\n") == 1, both.stderr


def test_serve_claims_stay_on_the_pin_the_serve_run_was_recorded_on():
    """The server probes are v0.32.0's: another release is held to no serve claim (it has no serve run)."""
    for pin in ("v0.31.0", "v0.21.0"):
        assert not [n for n, p in verify.proofs_for_pin(pin).items() if p.scenario == verify.SERVE], pin


def test_show_links_a_served_abort_to_the_serving_notes(cli):
    run = _served_run()
    step = next(s.index for s in run.steps if s.aborts)
    r = cli("show", verify.recorded_run(PIN, verify.SERVE), "--step", step)
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "Abort (a client gone, a stop string) → notes: serve-abort-frees-blocks (EngineCore.abort_requests)" in out
