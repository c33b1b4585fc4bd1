"""pytest fixtures for "my component vs upstream" checks, on the same harness as `vllm-tour compare`.

Enable in a conftest.py:   pytest_plugins = ["vllm_tour.compare.pytest_plugin"]
or on the command line:    pytest -p vllm_tour.compare.pytest_plugin

    def test_my_scheduler(compare_upstream):
        result = compare_upstream("reimpl.chunked_prefill", "cmp_chunked", impl={"scheduler": "labs/my_sched.py"})
        assert_matches_upstream(result)

    def test_my_numbers(upstream_run):
        run = upstream_run("traces/scenarios/cmp_preempt.toml")
        assert run.steps[5]["scheduler"]["preempted"][0]["req_id"] == "c"

Upstream runs once per scenario per session (and is cached on disk by
scenario content, see upstream.upstream_run_for); the reimpl runs in-process.
`impl` takes the same components as `vllm-tour compare --impl` (components.COMPONENTS),
as "FILE.py[:Name]" or as the class/function itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_tour.compare import harness
from vllm_tour.compare.reimpl_side import applicable, check_module, engine_components
from vllm_tour.compare.result import CompareResult
from vllm_tour.compare.upstream import load_capture, load_upstream, upstream_run_for


@dataclass
class UpstreamRun:
    """A finished upstream run, loaded: meta.json, outputs, and records grouped by step."""

    scenario: object
    run_dir: Path
    meta: dict
    outputs: dict[str, list[int]]  # req_id -> generated token ids
    steps: dict[int, dict]  # step -> {"scheduler", "kv", "runner", "attention", "captures"}

    def capture(self, name: str, step: int):
        """A captured tensor (e.g. "attn_out.layers.0") of one step, as saved by upstream."""
        for rec in self.steps.get(step, {}).get("captures", []):
            if rec["name"] == name:
                return load_capture(self.run_dir, rec)
        raise KeyError(f"no capture {name!r} at step {step} in {self.run_dir}")


def _resolve(scenario: str | Path) -> Path:
    p = Path(scenario)
    if p.is_file():
        return p
    named = harness.SCENARIOS_DIR / (p.name if p.suffix == ".toml" else f"{p}.toml")
    return named if named.is_file() else p


@pytest.fixture(scope="session")
def upstream_run():
    """upstream_run(scenario path or name) -> UpstreamRun, one engine run per scenario per session."""
    from vllm_tour.scenario import load_scenario

    cache: dict[Path, UpstreamRun] = {}

    def get(scenario: str | Path) -> UpstreamRun:
        path = _resolve(scenario).resolve()
        if path not in cache:
            sc = load_scenario(path)
            up = load_upstream(upstream_run_for(sc))
            cache[path] = UpstreamRun(sc, up.run_dir, up.meta, up.outputs, up.steps)
        return cache[path]

    return get


@pytest.fixture
def compare_upstream(upstream_run):
    """compare_upstream(module, scenario, impl={...}, **kw) -> CompareResult, reusing the session's upstream runs."""

    def run(module: str, scenario: str | Path, impl: dict | None = None, **kw) -> CompareResult:
        from vllm_tour.errors import TourError
        from vllm_tour.scenario import load_scenario

        check_module(module)
        engine_components(module, impl)  # a broken impl fails here, before upstream may have to run
        sc = load_scenario(_resolve(scenario))
        if why := applicable(sc, module):  # e.g. an engine option the reimpl cannot carry: before upstream runs
            raise TourError(f"scenario {sc.name}: the reimpl cannot run it: {why}")
        up = upstream_run(scenario)
        return harness.compare(module, _resolve(scenario), upstream_run=up.run_dir, impl=impl, **kw)

    return run


def format_first(result: CompareResult) -> str:
    f = result.first  # in data-flow order: a tensor out of tolerance can come before a decision of its step
    bad = next((t for t in result.bad_tensors if f is not None and (t.name, t.step) == (f.field, f.step)), None)
    if bad is not None:
        return (f"{result.module} on {result.scenario}: tensor {bad.name} at step {bad.step} out of tolerance: "
                f"max|Δ|={bad.max_abs:.3g} (atol {bad.atol:g}, rtol {bad.rtol:g}) {bad.note}".rstrip())
    if f is not None:
        where = f"step {f.step}" if f.step is not None else "outputs"
        return (f"{result.module} diverges from upstream on {result.scenario} at {where}, field {f.field}: "
                f"upstream={f.upstream!r} reimpl={f.reimpl!r} {f.message}".rstrip())
    bad = result.bad_tensors
    if bad:
        t = bad[0]
        return (f"{result.module} on {result.scenario}: tensor {t.name} at step {t.step} out of tolerance: "
                f"max|Δ|={t.max_abs:.3g} (atol {t.atol:g}, rtol {t.rtol:g}) {t.note}".rstrip())
    return "clean"


def assert_matches_upstream(result: CompareResult) -> None:
    """Fail with the first divergence (step and field) unless the comparison is clean."""
    if not result.clean:
        raise AssertionError(format_first(result))
