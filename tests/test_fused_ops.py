"""reimpl/fused_ops.py (the fast path's fused elementwise kernels) on CPU, under the Triton interpreter.

The kernels run in a subprocess (tests/_fused_ops_worker.py, TRITON_INTERPRET=1), once per session, as
tests/test_triton_attn.py does for the attention kernel; these tests read its verdicts. Each kernel is
checked against its torch twin in fp32, fp16 and bf16, and `FastQwen3.forward` with the kernels
(`fused=True`, the GPU default) against the torch-op path (the CPU default) on a 2-layer model.
fp16 pins the roundings (the interpreter rounds fp32 -> fp16 to nearest, like the GPU): the norm and
q/k-norm+RoPE kernels are bit-exact there. bf16 is checked with a tolerance only: the interpreter
truncates fp32 -> bf16 where the GPU rounds to nearest even.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_fused_ops_worker.py")
CASES = ["add_rms_norm", "qk_norm_rope_kv", "silu_and_mul", "forward", "sample", "attention_plans", "bench_reference"]
DTYPES = ["fp32", "fp16", "bf16"]


@pytest.fixture(scope="session")
def interp():
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_torch(interp, case, dtype):
    r = interp[f"{case}-{dtype}"]
    assert "error" not in r, r.get("error")
    for key, v in r.items():
        if dtype == "bf16" and key == "residual_exact":
            continue  # the interpreter's truncating bf16 cast (see the module docstring)
        assert (v["ok"] if isinstance(v, dict) else v) is True, (key, v)


def test_roundings_match_torch_bit_for_bit_in_fp16(interp):
    """The fp32 residual sum normalised and stored rounded, the normed value rounded before the weight:
    the roundings of reimpl/qwen3_numerics.py, which both engines' torch paths use."""
    assert interp["add_rms_norm-fp16"]["out"]["frac_equal"] == 1.0
    assert interp["add_rms_norm-fp16"]["residual_exact"] is True
    assert interp["qk_norm_rope_kv-fp16"]["q"]["frac_equal"] == 1.0
    assert interp["qk_norm_rope_kv-fp16"]["k_cache"]["frac_equal"] == 1.0


def test_cache_write_touches_only_the_slots(interp):
    for dt in DTYPES:
        r = interp[f"qk_norm_rope_kv-{dt}"]
        assert r["other_slots_untouched"] is True and r["v_cache_exact"] is True


def test_cpu_default_keeps_torch_ops():
    import torch

    from reimpl.fast_engine import FastQwen3

    cfg = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
           "hidden_size": 16, "intermediate_size": 32, "vocab_size": 50, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 64, "tie_word_embeddings": True}
    assert FastQwen3.random(cfg, device="cpu", dtype=torch.float32).fused is False
