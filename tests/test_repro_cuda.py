"""The repro library on the CUDA pin (v0.21.0), re-checked here from the runs the GPU machine brought back.

`vllm_tour/gpu/runner.py repro` ran every library file that speaks about v0.21.0 on an H200
(traces/results/20261130-h200-v0.21.0-repros) and kept each run directory with a repro.json (the verdict, the
engine's failure and ERROR lines, each check) under traces/repros/cuda-v0.21.0/<name>/. This machine cannot run that
pin, so the expectations are evaluated again, by today's code, on those records: the verdict must follow from them
and be the one the file declares for v0.21.0."""

import json

import pytest

from vllm_tour.repro.reproduce import check_expectations
from vllm_tour.repro.library import REPROS_DIR, library
from vllm_tour.scenario import load_scenario
from vllm_tour.trace.reader import load_run

PIN = "v0.21.0"
CUDA = REPROS_DIR / "cuda-v0.21.0"
FILES = {load_scenario(p).name: p for p in library()}
RUNS = sorted(d.name for d in CUDA.iterdir() if (d / "repro.json").is_file())


def test_every_repro_that_speaks_about_the_cuda_pin_was_run_there():
    declared = {name for name, path in FILES.items() if PIN in load_scenario(path).pins()}
    assert declared and set(RUNS) == declared


@pytest.mark.parametrize("name", RUNS)
def test_cuda_verdict_follows_from_its_records_and_is_as_declared(name):
    saved = json.loads((CUDA / name / "repro.json").read_text())
    sc = load_scenario(FILES[name])
    run = load_run(CUDA / name)
    assert run.meta.pin == PIN and saved["pin"] == PIN
    checks = check_expectations(sc, run, saved["failure"], saved["log_errors"], sc.expect_for(PIN), saved.get("alone"))
    verdict = "REPRODUCED" if checks and all(c.ok for c in checks) else "NOT REPRODUCED"
    assert [(c.key, c.ok) for c in checks] == [(c["key"], c["ok"]) for c in saved["checks"]]
    assert verdict == saved["verdict"] == sc.declared_verdict(PIN)


def test_fixes_between_the_pins_show_in_both_verdicts():
    """Where a fix landed between v0.21.0 and v0.32.0, the CUDA run reproduced what the CPU pin does not."""
    differ = [n for n in RUNS if load_scenario(FILES[n]).declared_verdict(PIN) != load_scenario(FILES[n]).declared_verdict("v0.32.0")]
    assert len(differ) >= 2
    reset = json.loads((CUDA / "async_reset_prefix_cache_placeholders" / "repro.json").read_text())
    assert reset["verdict"] == "REPRODUCED" and reset["failure"].startswith("AssertionError")
