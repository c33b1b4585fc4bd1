"""Golden traces: re-record each canonical scenario and compare deterministic fields exactly."""

import pytest

from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.engine.golden import GOLDEN_SCENARIOS, deterministic, first_differences
from vllm_tour.trace.reader import load_run


@pytest.mark.parametrize("name", GOLDEN_SCENARIOS)
def test_rerecorded_trace_matches_golden(trace_runs, name):
    golden = load_run(GOLDEN_DIR / name)
    fresh = load_run(trace_runs.get(name))
    diffs = first_differences(deterministic(golden), deterministic(fresh))
    assert not diffs, f"{name} differs from traces/golden/{name} (re-record with python -m vllm_tour.engine.golden {name} if intended):\n" + "\n".join(diffs)


@pytest.mark.parametrize("name", GOLDEN_SCENARIOS)
def test_golden_traces_are_small_and_complete(name):
    d = GOLDEN_DIR / name
    assert sum(f.stat().st_size for f in d.iterdir()) < 400_000
    run = load_run(d)
    assert run.finished and run.steps and not run.warnings
    assert run.steps[0].index == 1 and [s.index for s in run.steps] == list(range(1, len(run.steps) + 1))


def test_first_differences_points_at_the_field():
    a = {"steps": [{"kv": {"block_tables": {"r1": [1, 2]}}}]}
    b = {"steps": [{"kv": {"block_tables": {"r1": [1, 3]}}}]}
    assert first_differences(a, b) == ["steps[0].kv.block_tables.r1[1]: expected 2 got 3"]
