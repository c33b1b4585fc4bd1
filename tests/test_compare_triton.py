"""`vllm-tour compare reimpl.triton_attn`: the mini engine with the Triton kernel
(interpreted on CPU) against the live upstream engine's captured attention."""

import json
import subprocess
import sys

from vllm_tour.paths import SCENARIOS_DIR

# Run in a subprocess: Triton reads TRITON_INTERPRET when the kernel is first
# imported, and this pytest process may already hold a non-interpreted import.
MUTATE = """
import sys
import reimpl.triton_attn as t
orig = t.engine_attention
t.engine_attention = lambda *a: orig(*a) * 1.001  # a kernel 0.1% off
from vllm_tour.cli import main
sys.argv = ["vllm-tour", "compare"] + sys.argv[1:]
main()
"""


def _compare(tmp_path, *extra, mutate=False):
    out = tmp_path / "report.json"
    args = ["reimpl.triton_attn", "--scenario", str(SCENARIOS_DIR / "cmp_single.toml"), "--json", str(out)]
    cmd = [sys.executable, "-c", MUTATE, *args] if mutate else [sys.executable, "-m", "vllm_tour", "compare", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    return r, json.loads(out.read_text()) if out.exists() else None


def test_triton_kernel_in_the_engine_matches_upstream(tmp_path):
    r, report = _compare(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = report["scenarios"][0]
    names = {t["name"] for t in res["tensors"]}
    assert {"attn_out.layers.0", "attn_out.layers.1"} <= names
    assert all(t["ok"] and t["max_abs"] <= 1e-5 for t in res["tensors"])


def test_a_kernel_off_by_0_1_percent_is_caught(tmp_path):
    r, report = _compare(tmp_path, mutate=True)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    bad = report["scenarios"][0]["first_tensor_out_of_tolerance"]
    assert bad["name"].startswith("attn_out.layers.") and bad["step"] == 1


def test_in_a_process_that_already_imported_triton_it_says_so(monkeypatch):
    import pytest
    import triton  # noqa: F401  (as vLLM's import does, before any compare)

    from vllm_tour.compare import harness
    from vllm_tour.errors import TourError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(TourError, match="set TRITON_INTERPRET=1 before Python starts"):
        harness.check_module("reimpl.triton_attn")
