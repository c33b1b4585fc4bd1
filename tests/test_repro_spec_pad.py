"""spec_pad_max_model_len_stall (issue 35 item 4): a speculative-decoding repro with a verdict per release.

Upstream PR #53962 (in v0.29.0) stopped the waiting loop from `break`ing when a one-token request padded to
1 + num_speculative_tokens would not fit `max_model_len`; v0.28.0 starves the request while others run. The file
declares REPRODUCED on v0.28.0 (24 steps without a token, `repro --bisect` here) and NOT REPRODUCED from v0.29.0
on. These tests run it on the installed release (v0.32.0) and on v0.31.0 (the `release_env` environment) as a user
does, `repro FILE [--pin TAG]`, and read the trace for the fixed path: the request scheduled, un-padded, the step
it arrives. On v0.28.0 that check fails (the request is not scheduled until `long` finishes).
"""

import pytest

from vllm_tour.repro.library import REPROS_DIR
from vllm_tour.scenario import load_scenario
from vllm_tour.trace.reader import load_run

REPRO = REPROS_DIR / "spec_pad_max_model_len_stall.toml"


def test_the_file_declares_the_fix_in_v0_29_0():
    sc = load_scenario(REPRO)
    assert sc.pr == 53962 and sc.engine.extra["speculative_config"]["method"] == "ngram"
    assert [sc.declared_verdict(p) for p in ("v0.28.0", "v0.29.0", "v0.30.0", "v0.31.0", "v0.32.0")] == [
        "REPRODUCED", *["NOT REPRODUCED"] * 4]
    # the case v0.28.0 breaks on: 32 cached tokens + 1 + k placeholder drafts do not fit max_model_len
    k = sc.engine.extra["speculative_config"]["num_speculative_tokens"]
    again = next(r for r in sc.requests if r.req_id == "again")
    assert len(again.prompt_token_ids) == 33 and 32 + 1 + k > sc.engine.max_model_len


@pytest.mark.parametrize("pin", [None, "v0.31.0"], ids=["installed", "v0.31.0"])
def test_verdict_and_the_unpadded_schedule_on_the_release(cli, request, tmp_path, pin):
    if pin:
        request.getfixturevalue("release_env")
    out = tmp_path / "run"
    r = cli("repro", REPRO, *(["--pin", pin] if pin else []), "--out", out, timeout=900)
    here = pin or "v0.32.0"
    assert r.returncode == 1, r.stdout + r.stderr  # NOT REPRODUCED
    assert f"NOT REPRODUCED on {here}" in r.stdout and "(as declared)" in r.stdout, r.stdout
    assert "again was scheduled in every step it was in the engine with other work" in r.stdout
    # the releases it speaks about that this command did not run: CPU releases, each in its own environment
    assert "v0.28.0: not run here (another CPU release: `repro FILE --pin v0.28.0` runs it" in r.stdout
    run = load_run(out)
    assert run.meta.vllm_version == here.lstrip("v")
    rows = [(s.index, x) for s in run.steps if s.scheduler for x in s.scheduler.scheduled if x.req_id == "again"]
    step, first = rows[0]
    # scheduled with its one real token over the 32 cached ones: no placeholder drafts (32 + 4 > 35)
    assert (first.kind, first.num_scheduled_tokens, first.num_computed_tokens) == ("new", 1, 32)
    assert not any(v.req_id == "again" for s in run.steps if s.spec_verify for v in s.spec_verify.requests)
    # ... while `long` still decodes: the step v0.28.0 would have skipped it
    by_index = {s.index: s for s in run.steps}
    assert any(x.req_id == "long" for x in by_index[step].scheduler.scheduled)
    assert "long" not in {f for s in run.steps if s.index <= step and s.scheduler for f in s.scheduler.finished}
    # the run shows speculative decoding at work: long's drafts verified
    assert any(v.req_id == "long" for s in run.steps if s.spec_verify for v in s.spec_verify.requests)


def test_a_cuda_pin_is_the_gpu_machines_and_a_cpu_pin_has_its_environment():
    from vllm_tour.repro.reproduce import GPU_PIN_NOTE, where_it_runs

    assert where_it_runs("v0.21.0") == GPU_PIN_NOTE
    assert where_it_runs("v0.30.0").startswith("another CPU release: `repro FILE --pin v0.30.0`")


# --- spec_dummy_drafts_near_max_model_len (upstream issue #58080, open): the drafter gate near max_model_len ---------

DUMMY = REPROS_DIR / "spec_dummy_drafts_near_max_model_len.toml"


@pytest.mark.parametrize("pin", [None, "v0.31.0"], ids=["installed", "v0.31.0"])
def test_dummy_drafts_repro_on_the_release(cli, request, tmp_path, pin):
    """REPRODUCED on v0.32.0 and v0.31.0: `long`, far from the limit, has [0, 0, 0] verified as its drafts because
    `near` is within k tokens of max_model_len; token 0 is in neither its prompt nor its output."""
    if pin:
        request.getfixturevalue("release_env")
    out = tmp_path / "run"
    r = cli("repro", DUMMY, *(["--pin", pin] if pin else []), "--out", out, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"REPRODUCED on {pin or 'v0.32.0'}" in r.stdout and "(as declared)" in r.stdout
    assert "long verified drafts [0, 0, 0] at position 7; [0] never in its 6 prompt" in r.stdout
    run = load_run(out)
    first = next(s for s in run.steps if s.spec_proposal)
    assert first.spec_proposal.proposed == {"long": [0, 0, 0], "near": [0, 0, 0]}  # the whole batch, one gate


def test_drafts_not_in_sequence_fails_on_ngram_drafts_and_says_why(upstream_run):
    """On spec_ngram (max_model_len 1024: the gate never closes) every verified draft is a token of the request's
    own sequence: the check does not hold, and its evidence says so."""
    from vllm_tour.repro.reproduce import check_expectations
    from vllm_tour.scenario import ExpectSpec, load_scenario as load
    from vllm_tour.paths import SCENARIOS_DIR

    run = load_run(upstream_run("spec_ngram").run_dir)
    sc = load(SCENARIOS_DIR / "spec_ngram.toml")
    [c] = check_expectations(sc, run, None, [], ExpectSpec(drafts_not_in_sequence=["rep"]))
    assert not c.ok and c.evidence[0].startswith("rep: ") and "each made of tokens of its own sequence" in c.evidence[0]


def test_drafts_not_in_sequence_needs_the_engine():
    from vllm_tour.errors import TourError
    from vllm_tour.scenario import scenario_from_dict

    with pytest.raises(TourError, match="drafts_not_in_sequence reads the drafts a model runner made"):
        scenario_from_dict({"name": "x", "mode": "scheduler", "requests": [{"id": "a", "token_ids": [1, 2]}],
                            "expect": {"drafts_not_in_sequence": ["a"]}})
