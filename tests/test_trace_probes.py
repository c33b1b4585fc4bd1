"""Probe declarations: resolution, signature checks and idempotent install (no engine needed)."""

import dataclasses

import pytest

from vllm_tour.errors import TourError
from vllm_tour.probes import install as inst
from vllm_tour.probes.base import Probe, resolve

PIN = "v0.32.0"


def test_every_declared_probe_resolves_on_the_pin():
    resolved = inst.check_probes(PIN)
    assert {r.probe.name for r in resolved} >= {"scheduler.schedule", "scheduler.preempt", "kv.free", "runner.execute_model", "attention.build"}
    for r in resolved:
        assert callable(r.original) and not hasattr(r.original, "__vllm_tour_probe__")


def test_missing_target_is_an_error_naming_target_and_pin():
    bad = Probe(name="x.gone", target="vllm.v1.core.sched.scheduler.Scheduler.schedule_v9", params=("self",), records="-", pins=(PIN,))
    with pytest.raises(TourError, match=r"vllm\.v1\.core\.sched\.scheduler\.Scheduler\.schedule_v9 not found on pin v0\.32\.0"):
        resolve(bad, PIN)


def test_unsupported_pin_is_an_error():
    probe = inst.PROBES[0]
    with pytest.raises(TourError, match="has not been checked against pin v9.9.9"):
        resolve(probe, "v9.9.9")


def test_changed_signature_is_an_error():
    probe = dataclasses.replace(inst.PROBES[0], params=("self", "renamed_arg"))
    with pytest.raises(TourError, match="expected \\(self, renamed_arg"):
        resolve(probe, PIN)


def test_install_is_idempotent():
    from vllm.v1.core.sched.scheduler import Scheduler

    inst.install_all(PIN)
    first = Scheduler.schedule
    assert inst.install_all(PIN) == 0
    assert Scheduler.schedule is first
    assert not hasattr(first.__vllm_tour_original__, "__vllm_tour_probe__")  # wrapped once, not twice


def test_missing_target_fails_before_the_engine_starts(monkeypatch, tmp_path):
    """run_upstream checks every target before it constructs an engine."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_tour.scenario import scenario_from_dict
    from vllm_tour.engine import run

    def engine_must_not_start(*a, **k):
        raise AssertionError("engine started despite a missing probe target")

    monkeypatch.setattr(LLMEngine, "from_engine_args", engine_must_not_start)
    bad = Probe(name="x.gone", target="vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slotz", params=("self",), records="-", pins=(PIN,))
    monkeypatch.setattr(inst, "PROBES", [*inst.PROBES, bad])
    sc = scenario_from_dict({"name": "t", "requests": [{"id": "r0", "prompt": "hi"}]})
    with pytest.raises(TourError, match="allocate_slotz not found on pin v0.32.0"):
        run.run_upstream(sc, tmp_path / "run")
    assert not (tmp_path / "run").exists()
