"""Upstream's CPU attention ISA: recorded in every trace, decoded in every capture, forceable.

Upstream takes the "amx" kernel for bf16 on a CPU with AMX tiles and "vec" elsewhere; the
two store the KV cache differently and sum in a different order. Both are compared here on
any AMX machine (the default run is amx, the scenario cmp_single_bf16_vec forces vec); on a
machine without AMX both runs are vec and test_kv_layout.py checks the AMX decoder.
"""

import subprocess
import sys

import pytest
import torch

from vllm_tour.compare.pytest_plugin import assert_matches_upstream
from vllm_tour.paths import REPO_ROOT, SCENARIOS_DIR
from vllm_tour.probes.kv_layout import CANONICAL_LAYOUT

UPSTREAM_BF16_ISA = "amx" if torch.cpu._is_amx_tile_supported() else "vec"


def _isas(run) -> tuple[set, set]:
    attention = {s["attention"].get("isa") for s in run.steps.values() if s.get("attention")}
    captures = {c.get("isa") for s in run.steps.values() for c in s["captures"] if c["name"].startswith("kv_blocks.")}
    return attention, captures


@pytest.mark.parametrize("scenario, isa", [("cmp_single_bf16", UPSTREAM_BF16_ISA), ("cmp_single_bf16_vec", "vec"),
                                           ("cmp_single", "vec")])
def test_the_isa_that_ran_is_recorded_and_its_kv_layout_decoded(upstream_run, compare_upstream, scenario, isa):
    run = upstream_run(scenario)
    assert _isas(run) == ({isa}, {isa})
    layouts = {c["layout"] for s in run.steps.values() for c in s["captures"] if c["name"].startswith("kv_blocks.")}
    assert layouts == {CANONICAL_LAYOUT}
    result = compare_upstream("reimpl.paged_attn", scenario)
    assert result.to_json()["tolerance"]["upstream_cpu_attention_isa"] == isa
    assert {t.name.split(".")[0] for t in result.tensors} == {"attn_out", "kv_blocks"}
    assert_matches_upstream(result)


def _trace(tmp_path, isa: str, dtype: str):
    src = (SCENARIOS_DIR / "cmp_single.toml").read_text()
    path = tmp_path / "forced.toml"
    path.write_text(src.replace("[engine]", f'[engine]\ncpu_attention_isa = "{isa}"\ndtype = "{dtype}"', 1))
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "vllm_tour.cli", "trace", "--scenario", str(path), "--out", str(out)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    return r, out


def test_forcing_amx_where_it_cannot_run_fails_before_the_engine(tmp_path):
    # float32 never runs on the AMX kernel; on a CPU without AMX the hardware is named first
    r, out = _trace(tmp_path, "amx", "float32")
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "cpu_attention_isa = 'amx'" in err[0] and "Traceback" not in r.stderr
    assert not out.exists()


def test_an_unknown_isa_is_a_scenario_error(tmp_path):
    r, out = _trace(tmp_path, "sse9", "float32")
    assert r.returncode == 2 and "cpu_attention_isa" in r.stdout + r.stderr and not out.exists()
