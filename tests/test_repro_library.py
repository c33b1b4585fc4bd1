"""The repro library (traces/repros/): verdicts per pin, the scheduler-only harness, raw engine options.

Every repro of the library runs here on the CPU pin and its verdict is asserted against the file's
declared one; the v0.21.0 expectations are reported as not run (the GPU machine runs them).
"""

import re

import pytest

from vllm_tour.errors import TourError
from vllm_tour.repro.reproduce import check_expectations
from vllm_tour.repro.library import REPROS_DIR, library
from vllm_tour.scenario import load_scenario, scenario_from_dict
from vllm_tour.trace.reader import load_run


def test_every_repro_in_the_library_runs_here_as_declared(cli):
    p = cli("repro", "--all", columns=400, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    out = p.stdout
    assert "every verdict as declared" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 4}
    names = [load_scenario(f).name for f in library()]
    assert len(names) >= 8 and set(names) <= set(rows)
    for f in library():
        sc = load_scenario(f)
        row = rows[sc.name]
        assert f"{sc.declared_verdict('v0.32.0')}" in row, row
        assert re.search(r"│\s*" + re.escape(sc.declared_verdict("v0.32.0")) + r"\s*│", row), row
        if "v0.21.0" in sc.pins():
            assert f"not run here; declared {sc.declared_verdict('v0.21.0')}" in row
        assert f"[{names.index(sc.name) + 1}/{len(names)}] {sc.name}: running on v0.32.0" in out  # progress
    # at least two fixes that landed between the pins: one pin reproduces, the other does not
    differ = [f for f in library() if len({load_scenario(f).declared_verdict(p) for p in ("v0.21.0", "v0.32.0")}) == 2]
    assert len(differ) >= 2
    # the evidence, one line per repro
    assert "r0 scheduled in 3 steps: step 1: 100, step 2: 1" in rows["long_prefill_lone_request"]
    assert "engine failed: ValueError: To serve at least one request with the model's max seq len (128)" in rows["kv_capacity_null_block"]
    assert "big waits (needs 5 blocks, 3 free); small waits though it would fit" in rows["head_of_line_blocking"]
    assert "4 block hashes in 3 BlockStored events" in rows["kv_events_full_report"]
    assert "salted: no prefix-cache hit" in rows["cache_salt_vs_lora"]
    # batch invariance: each request ran again alone, and fp32 on the CPU engine gave it the same tokens
    assert "r0 in the batch and alone: the same 24 tokens" in rows["batch_variance_fp32_cpu"]
    assert "BlockRemoved" in rows["kv_block_removed_per_copy"] and "stored copy of it stays cached" in rows["kv_block_removed_per_copy"]


@pytest.fixture(scope="module")
def hol_run(tmp_path_factory):
    """head_of_line_blocking through the scheduler-only harness, in this process."""
    from vllm_tour.engine.sched_harness import run_scheduler

    sc = load_scenario(REPROS_DIR / "head_of_line_blocking.toml")
    return sc, load_run(run_scheduler(sc, tmp_path_factory.mktemp("hol") / "run"))


def test_scheduler_harness_records_like_a_run(hol_run):
    sc, run = hol_run
    assert run.meta.status == "ok" and run.meta.engine_args["mode"] == "scheduler"
    assert run.meta.engine_args["scheduler_cls"] == "Scheduler"
    assert all(s.scheduler and s.kv and not s.runner and not s.attention for s in run.steps)
    first = {r: min(s.index for s in run.steps for x in s.scheduler.scheduled if x.req_id == r) for r in ("running", "big", "small")}
    assert first["running"] == 1 and first["small"] >= first["big"] > 30  # both wait until `running` finishes
    assert {o.req_id: len(o.token_ids) for o in run.outputs.requests} == {"running": 40, "big": 2, "small": 2}
    s3 = run.step(3)
    assert s3.kv.free_blocks == 3 and [x.req_id for x in s3.scheduler.scheduled] == ["running"]


def test_scheduling_expectations_fail_with_evidence_when_they_do_not_hold(hol_run):
    sc, run = hol_run
    ex = sc.expect.model_copy(update={"blocked_behind": {"big": "small"}, "stalled": {"small": 100},
                                      "max_scheduled_tokens": {"running": 32}, "never_scheduled": ["small"]})
    checks = {c.key: c for c in check_expectations(sc, run, None, [], ex)}
    assert not checks["blocked_behind.big = small"].ok and "arrived at step 3, after big" in checks["blocked_behind.big = small"].evidence[0]
    assert not checks["stalled.small >= 100 steps"].ok and "38 consecutive steps (3..40)" in checks["stalled.small >= 100 steps"].evidence[0]
    assert not checks["max_scheduled_tokens.running <= 32"].ok and "step 1: 64" in checks["max_scheduled_tokens.running <= 32"].evidence[0]
    assert not checks["never_scheduled: small"].ok and "scheduled 10 tokens" in checks["never_scheduled: small"].evidence[0]


def _harness(tmp_path, sc):
    from vllm_tour.engine.sched_harness import run_scheduler

    return load_run(run_scheduler(sc, tmp_path / "run"))


def test_cache_salt_is_not_a_lora_name_here_while_the_same_lora_shares_blocks(tmp_path):
    """The control for cache_salt_vs_lora: the harness hashes LoRA requests, so two under LoRA X share both
    full blocks; a cache salt X shares none on this pin (v0.21.0: the first block)."""
    sc = load_scenario(REPROS_DIR / "cache_salt_vs_lora.toml")
    run = _harness(tmp_path / "salt", sc)
    assert not any(h.req_id == "salted" and h.num_hit_tokens for s in run.steps for h in s.kv.prefix_hits)
    assert not check_expectations(sc, run, None, [], sc.expect)[0].ok
    same = sc.model_copy(update={"request_options": {**sc.request_options, "salted": sc.request_options["lora"]}})
    run = _harness(tmp_path / "lora", same)
    hits = [h for s in run.steps for h in s.kv.prefix_hits if h.req_id == "salted"]
    assert [h.num_hit_tokens for h in hits] == [64]
    assert run.meta.requests[1].prompt_token_ids == run.meta.requests[0].prompt_token_ids


def test_kv_events_are_recorded_and_counted(tmp_path):
    import json

    sc = load_scenario(REPROS_DIR / "kv_block_removed_per_copy.toml")
    run = _harness(tmp_path, sc)
    assert run.meta.engine_args["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "null"}
    events = json.loads((run.path / "kv_events.json").read_text())["events"]
    stored = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
    removed = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved")
    assert stored and removed
    hashes = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert len(hashes) > len(set(hashes))  # one hash stored in two physical blocks
    ex = sc.expect.model_copy(update={"kv_events": {"BlockStored": stored, "BlockRemoved": removed + 1},
                                      "kv_removed_while_cached": False})
    checks = {c.key: c for c in check_expectations(sc, run, None, [], ex)}
    assert checks[f"kv_events.BlockStored = {stored}"].ok
    assert not checks[f"kv_events.BlockRemoved = {removed + 1}"].ok
    assert f"{removed} block hashes in" in checks[f"kv_events.BlockRemoved = {removed + 1}"].evidence[0]
    assert not checks["kv_removed_while_cached = false"].ok
    # without kv_events_config there is no event log, and the check says how to get one
    plain = sc.model_copy(update={"engine": sc.engine.model_copy(update={"extra": {}})})
    run = _harness(tmp_path / "plain", plain)
    c = check_expectations(plain, run, None, [], plain.expect)[0]
    assert not c.ok and "kv_events_config" in c.evidence[0]


def test_the_harness_sizes_the_pool_with_the_pins_own_capacity_check(tmp_path):
    """kv_capacity_null_block: memory for 4 blocks is refused here (the null block is reserved); memory for 5
    starts, and r0 (4 blocks) is scheduled at once, so never_scheduled fails with that step as evidence."""
    from vllm_tour.engine.sched_harness import run_scheduler

    sc = load_scenario(REPROS_DIR / "kv_capacity_null_block.toml")
    with pytest.raises(TourError) as e:
        run_scheduler(sc, tmp_path / "four")
    assert "estimated maximum model length is 96" in str(e.value.__cause__)
    assert load_run(tmp_path / "four").meta.status == "failed"
    five = sc.model_copy(update={"engine": sc.engine.model_copy(update={"kv_cache_memory_bytes": 5 * 65536})})
    run = load_run(run_scheduler(five, tmp_path / "five"))
    assert run.steps[0].kv.num_blocks == 4  # 5 blocks, one of them the null block
    c = check_expectations(five, run, None, [], five.expect)[0]
    assert not c.ok and c.evidence == ["step 1: r0 scheduled 127 tokens"]


def test_reset_prefix_cache_mid_flight_under_async_scheduling(tmp_path):
    """async_reset_prefix_cache_placeholders on this pin: the reset preempts both requests with two batches in
    flight, they are recomputed (chunked by the 64-token budget), and v0.32.0 finishes them with no assertion."""
    sc = load_scenario(REPROS_DIR / "async_reset_prefix_cache_placeholders.toml")
    run = _harness(tmp_path / "reset", sc)
    assert run.meta.engine_args["scheduler_cls"] == "AsyncScheduler" and run.meta.status == "ok"
    kinds = {(s.index, x.req_id): (x.kind, x.num_scheduled_tokens) for s in run.steps for x in s.scheduler.scheduled}
    assert kinds[(7, "r0")] == ("resumed", 64) and ("resumed", 60) in {kinds[k] for k in kinds if k[1] == "r1"}
    assert sorted(len(o.token_ids) for o in run.outputs.requests) == [20, 20]
    checks = {c.key: c.ok for c in check_expectations(sc, run, None, [], sc.expect)}
    assert checks == {'resumed = ["r0"]': True, 'engine_fails_with = "AssertionError"': False}
    # without the reset nothing is resumed: the call is what the repro exercises
    plain = _harness(tmp_path / "plain", sc.model_copy(update={"reset_prefix_cache_at_step": None}))
    assert not any(x.kind == "resumed" for s in plain.steps for x in s.scheduler.scheduled)


def test_request_options_need_the_scheduler_harness():
    with pytest.raises(TourError, match="request_options and reset_prefix_cache_at_step are the scheduler-only harness's"):
        scenario_from_dict({"name": "x", "requests": [{"id": "r0", "prompt": "p"}],
                            "request_options": {"r0": {"cache_salt": "s"}}})
    with pytest.raises(TourError, match="request_options names unknown request ids: r9"):
        scenario_from_dict({"name": "x", "mode": "scheduler", "requests": [{"id": "r0", "prompt": "p"}],
                            "request_options": {"r9": {"cache_salt": "s"}}})


def test_unknown_extra_engine_option_is_one_line_exit_2(tmp_path, cli):
    sc = tmp_path / "s.toml"
    sc.write_text('name = "x"\nmode = "scheduler"\n[engine.extra]\nno_such_option = 1\n'
                  '[[requests]]\nid = "r0"\nprompt = "hi"\n[expect]\npreempted = ["r0"]\n')
    p = cli("repro", sc, "--out", tmp_path / "run", timeout=120, columns=250)
    assert p.returncode == 2 and "REPRODUCED" not in p.stdout
    assert p.stderr.strip() == "error: engine.extra.no_such_option: the installed vLLM's EngineArgs has no field 'no_such_option'"
    assert not (tmp_path / "run" / "meta.json").exists()  # it failed before anything ran


def test_extra_options_reach_engine_args_and_typed_ones_are_refused():
    from vllm_tour.engine.run import extra_engine_args

    assert extra_engine_args({"long_prefill_token_threshold": 32}, typed={"block_size"}) == {"long_prefill_token_threshold": 32}
    with pytest.raises(TourError, match="engine.extra.block_size: set by the scenario's typed"):
        extra_engine_args({"block_size": 64}, typed={"block_size"})
    with pytest.raises(TourError, match="no secrets"):
        extra_engine_args({"hf_token": "x"}, typed=set())


def _sc(expect: dict, **kw):
    return scenario_from_dict({"name": "x", "requests": [{"id": "r0", "prompt": "p"}, {"id": "r1", "prompt": "q"}],
                               "expect": expect, **kw})


def test_per_pin_expectations_merge_on_the_common_ones():
    sc = _sc({"preempted": ["r0"], "v0.21.0": {"never_scheduled": ["r1"]}, "v0.32.0": {"preempted": ["r1"]}},
             verdicts={"v0.32.0": "NOT REPRODUCED"})
    assert sc.pins() == ["v0.21.0", "v0.32.0"]
    assert sc.expect_for("v0.21.0").keys() == ["preempted", "never_scheduled"]
    assert sc.expect_for("v0.32.0").preempted == ["r1"]  # the pin's own key wins
    assert sc.declared_verdict("v0.21.0") == "REPRODUCED" and sc.declared_verdict("v0.32.0") == "NOT REPRODUCED"
    with pytest.raises(TourError, match="expect names unknown request ids: r9"):
        _sc({"v0.21.0": {"stalled": {"r9": 3}}})
    with pytest.raises(TourError, match="verdicts names pin v0.30.0 but there are no expectations"):
        _sc({"v0.21.0": {"preempted": ["r0"]}}, verdicts={"v0.30.0": "REPRODUCED"})


def test_a_repro_for_another_pin_only_is_not_run_here(tmp_path, cli):
    sc = tmp_path / "s.toml"
    sc.write_text('name = "x"\n[[requests]]\nid = "r0"\nprompt = "hi"\n[expect."v0.21.0"]\npreempted = ["r0"]\n')
    p = cli("repro", sc, timeout=120, columns=250)
    assert p.returncode == 2 and "REPRODUCED" not in p.stdout
    assert p.stderr.strip() == f"error: scenario {sc} has expectations for v0.21.0 only; this machine runs v0.32.0 " \
                               "(see `vllm-tour repro --all` for the other pins' status)"


def test_same_tokens_alone_needs_the_model():
    with pytest.raises(Exception, match='same_tokens_alone compares generated tokens: it needs mode = "engine"'):
        scenario_from_dict({"name": "x", "mode": "scheduler", "requests": [{"id": "r0", "token_ids": [1, 2, 3]}],
                            "expect": {"same_tokens_alone": {"r0": True}}})
