"""bf16 compare: tokens by vLLM's top-5 rule (reimpl on upstream's tokens after a difference), tensors at bf16 tolerance."""

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from reimpl import paged_attn
from reimpl.engine import Engine
from reimpl.qwen3 import Qwen3
from vllm_tour.bench.bf16_error_stats import engine_factory
from vllm_tour.cli import app
from vllm_tour.compare import tolerance
from vllm_tour.compare.harness import compare
from vllm_tour.compare.report import render
from vllm_tour.compare.tokens import logprobs_close
from vllm_tour.errors import TourError
from vllm_tour.paths import SCENARIOS_DIR


# --- the rule and the tolerance (no engine) ------------------------------------------------


def test_logprobs_close_identical_pass_fail():
    up, top_up = [5, 6, 7, 8], [[5, 1], [6, 2], [7, 9, 3], [8]]
    assert logprobs_close(up, up, top_up, top_up) == {"ok": True, "identical": True, "first_diff": None}
    # position 2: 7 vs 9, each in the other's top -> ok, and nothing after it is compared
    r = logprobs_close(up, [5, 6, 9, 0], top_up, [[5], [6], [9, 7], [0]])
    assert (r["ok"], r["identical"], r["first_diff"], r["upstream"], r["reimpl"]) == (True, False, 2, 7, 9)
    # the reimpl's 4 is not in upstream's top at position 2
    r = logprobs_close(up, [5, 6, 4, 8], top_up, [[5], [6], [4, 7], [8]])
    assert not r["ok"] and r["upstream_in_reimpl_top"] and not r["reimpl_in_upstream_top"]
    # upstream's 7 is not in the reimpl's top
    r = logprobs_close(up, [5, 6, 9, 8], top_up, [[5], [6], [9, 3], [8]])
    assert not r["ok"] and r["reimpl_in_upstream_top"] and not r["upstream_in_reimpl_top"]
    assert not logprobs_close(up, up[:3], top_up, top_up)["ok"]  # a missing token is not close


def test_tolerance_follows_the_run_dtype():
    for backend, env in (("CPUAttention", None), ("TritonAttention", None), ("TritonAttention", {"TRITON_F32_DEFAULT": "ieee"})):
        assert tolerance.tolerance_for(backend, env, "bfloat16") is tolerance.BF16
    assert tolerance.tolerance_for("CPUAttention", None, "float32") is tolerance.FP32
    assert (tolerance.BF16.atol, tolerance.BF16.rtol, tolerance.BF16.name) == (5e-2, 1e-2, "bf16") and tolerance.BF16.reason
    assert (tolerance.BF16.max_gain, tolerance.BF16.max_rel_rms) == (2.0**-10, 2.0**-6) and "gain" in tolerance.BF16.rule
    for fp32 in (tolerance.FP32, tolerance.TF32_DOTS, tolerance.FP32_IEEE_DOTS):  # fp32 is judged by its max alone
        assert (fp32.max_gain, fp32.max_rel_rms) == (None, None)


def _steps(scale: float, noise_ulps: float, steps: int = 8, seed: int = 0) -> list[tolerance.TensorStat]:
    """A bf16 reference per step and a reimpl = reference x scale + noise_ulps ulps of random rounding, in bf16."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(1, steps + 1):
        ref = torch.randn(64, 256, generator=g).bfloat16()
        ulp = 2.0 ** (torch.frexp(ref.float())[1] - 8).float()
        mine = (ref.float() * scale + noise_ulps * ulp * torch.randn(ref.shape, generator=g)).bfloat16()
        out.append(tolerance.compare_tensor("attn_out.layers.0", step, ref, mine, tolerance.BF16.atol, tolerance.BF16.rtol))
    return out


def test_pooled_statistics_tell_a_scale_bug_from_rounding():
    """Per element both are within a few ulps, so within the max rule; pooled over the steps the 0.5% scale
    is a gain of 5e-3 and fails, unbiased rounding noise of half an ulp does not. fp32 gets no pooled row."""
    noise = tolerance.pool_steps(_steps(1.0, 0.5), tolerance.BF16)
    scaled = tolerance.pool_steps(_steps(1.005, 0.0), tolerance.BF16)
    assert all(s.ok for s in noise + scaled if s.step is not None)
    (pooled,) = [s for s in noise if s.step is None]
    assert pooled.ok and abs(pooled.gain) < 2e-4 and pooled.numel == 8 * 64 * 256
    (pooled,) = [s for s in scaled if s.step is None]
    assert not pooled.ok and pooled.failed == ["gain"] and 4e-3 < pooled.gain < 6e-3
    assert pooled.note.startswith("all 8 steps pooled") and "|gain|" in pooled.note
    big = tolerance.pool_steps(_steps(1.0, 4.0), tolerance.BF16)  # unbiased but 4 ulps everywhere: rel_rms, not gain
    assert [s.failed for s in big if s.step is None] == [["rel_rms"]]
    assert tolerance.pool_steps(_steps(1.005, 0.0), tolerance.FP32) == _steps(1.005, 0.0)
    moved = tolerance.TensorStat("kv_blocks.layers.0", 1, [2], float("inf"), float("inf"), 5e-2, 1e-2, False, "other blocks")
    assert moved.failed == ["max_abs"] and tolerance.pool_steps([moved], tolerance.BF16) == [moved]  # nothing to pool


# --- upstream in bf16 ------------------------------------------------------------------------


def test_bf16_trace_records_dtype_and_top5(upstream_run):
    run = upstream_run("cmp_single_bf16")
    assert run.meta["engine_args"]["dtype"] == "bfloat16" and run.meta["engine_args"]["logprobs"] == 5
    out = json.loads((run.run_dir / "outputs.json").read_text())["requests"][0]
    assert len(out["top_token_ids"]) == len(out["token_ids"]) == 12
    for tok, top, lps in zip(out["token_ids"], out["top_token_ids"], out["top_logprobs"]):
        assert len(top) == len(lps) == 5 and tok in top and lps == sorted(lps, reverse=True)
    caps = run.steps[1]["captures"]
    assert {c["dtype"] for c in caps} == {"bfloat16"}
    assert {layer["kv_cache_dtype"] for layer in run.steps[1]["attention"]["layers"]} == {"bfloat16"}


# --- the reimpl in bf16 against it -----------------------------------------------------------


def test_reimpl_engine_runs_in_bf16():
    """Weights, activations and the KV cache in bf16; its own greedy tokens and top-5 recorded."""
    from reimpl.engine import EngineConfig, RequestIn
    from vllm_tour.upstream.models import resolve_model

    eng = Engine(EngineConfig(str(resolve_model("tiny-qwen3")), num_blocks=8, dtype="bfloat16"))
    eng.record_topk = 5
    eng.run([RequestIn("r", [17, 42, 5, 99], 3)])
    assert eng.caches[0].k.dtype == torch.bfloat16 and eng.model.w["model.norm.weight"].dtype == torch.bfloat16
    assert eng.model.last_attn_out[0].dtype == torch.bfloat16
    assert eng.greedy["r"] == eng.outputs()["r"] and [len(t) for t in eng.topk["r"]] == [5, 5, 5]
    assert all(g in t for g, t in zip(eng.greedy["r"], eng.topk["r"]))


@pytest.mark.parametrize("module,name", [
    ("reimpl.paged_attn", "cmp_single_bf16"), ("reimpl.paged_attn", "cmp_chunked_bf16"),
    ("reimpl.paged_attn", "cmp_preempt_bf16"),
    ("reimpl.chunked_prefill", "cmp_single_bf16"), ("reimpl.chunked_prefill", "cmp_chunked_bf16"),
])
def test_bf16_reimpl_matches_upstream(compare_upstream, module, name):
    r = compare_upstream(module, name)
    assert r.exit_code == 0, (r.first, r.bad_tensors[:1])
    assert r.steps_upstream == r.steps_reimpl > 0
    j = r.to_json()
    assert j["dtype"] == "bfloat16" and j["tolerance"]["name"] == "bf16"
    assert (j["tolerance"]["atol"], j["tolerance"]["rtol"]) == (5e-2, 1e-2)  # never fp32's 1e-5
    assert "check_logprobs_close" in j["tokens_rule"] and "tokens" not in j["tolerance"]["exact"]
    assert all(t["top_k_rule"]["ok"] for t in r.tokens.values())
    if module == "reimpl.paged_attn":
        names = {t.name for t in r.tensors}
        assert {"attn_out.layers.0", "attn_out.layers.1", "kv_blocks.layers.0", "kv_blocks.layers.1"} <= names
        assert len(r.tensors) == 4 * r.steps_upstream + 4  # every step, both layers; and each pooled over the steps
        assert all(t.ok and t.atol == 5e-2 for t in r.tensors)


def test_bf16_preempted_request_recomputes(upstream_run):
    steps = upstream_run("cmp_preempt_bf16").steps.values()
    assert any(s["scheduler"]["preempted"] for s in steps)
    assert any(r["kind"] == "resumed" for s in steps for r in s["scheduler"]["scheduled"])


# --- mutations at bf16 tolerance -------------------------------------------------------------


def test_bf16_off_by_one_slot_mapping(compare_upstream, monkeypatch):
    orig = paged_attn.slot_mapping
    monkeypatch.setattr(paged_attn, "slot_mapping", lambda table, pos, bs: [s + 1 for s in orig(table, pos, bs)])
    r = compare_upstream("reimpl.paged_attn", "cmp_single_bf16")
    assert r.exit_code == 1 and r.tolerance is tolerance.BF16
    assert (r.first.step, r.first.field) == (1, "runner.requests[r0].slot_mapping")
    assert any(not t.ok for t in r.tensors if t.name.startswith("kv_blocks.") and t.step == 1)  # the cache contents moved


def test_bf16_attention_5_percent_off(compare_upstream):
    """Decisions all agree; only the attention output is off, by more than bf16 rounding explains."""
    def scaled(*a):
        return paged_attn.paged_attention(*a) * 1.05

    r = compare_upstream("reimpl.paged_attn", "cmp_single_bf16",
                         engine_factory=lambda cfg: Engine(cfg, model=Qwen3(cfg.model_dir, attention=scaled, dtype=cfg.dtype)))
    assert r.exit_code == 1 and not [d for d in r.divergences if d.kind != "tokens"]
    first = r.to_json()["first_tensor_out_of_tolerance"]
    assert (first["name"], first["step"], first["atol"]) == ("attn_out.layers.0", 1, 5e-2)


# --- small real bugs: within bf16's max |Δ|, caught by the pooled statistics -------------------

BF16_SCENARIOS = ("cmp_single_bf16", "cmp_chunked_bf16", "cmp_preempt_bf16")


@pytest.mark.parametrize("name", BF16_SCENARIOS)
def test_correct_reimpl_attention_is_within_bf16_on_every_scenario(compare_upstream, name):
    """Every attention output, per step and pooled over the steps. (kv_blocks: test_bf16_reimpl_matches_upstream.)"""
    r = compare_upstream("reimpl.paged_attn", name)
    attn = [t for t in r.tensors if t.name.startswith("attn_out.")]
    assert len(attn) == 2 * r.steps_upstream + 2 and [t for t in attn if not t.ok] == []
    pooled = {t.name: t for t in attn if t.step is None}
    assert all(abs(t.gain) < tolerance.BF16.max_gain / 2 and t.rel_rms < tolerance.BF16.max_rel_rms for t in pooled.values())
    assert not [d for d in r.divergences if d.kind != "tokens"]


def _pooled(r, name: str) -> tolerance.TensorStat:
    return next(t for t in r.tensors if t.name == name and t.step is None)


@pytest.mark.parametrize("mutation", ["softmax_scale", "sqrt_d_minus_1", "rmsnorm_weight"])
def test_a_one_percent_bug_passes_the_max_and_fails_the_gain(compare_upstream, mutation):
    """Softmax scale x1.01 or 1/sqrt(head_dim - 1), input RMSNorm weight x1.005: every decision agrees and
    attention is within the max |Δ| rule at every step; over the steps layer 0's output is scaled."""
    r = compare_upstream("reimpl.paged_attn", "cmp_single_bf16", engine_factory=engine_factory("reimpl.paged_attn", mutation))
    assert r.exit_code == 1 and not [d for d in r.divergences if d.kind != "tokens"]
    assert all(t.ok for t in r.tensors if t.name.startswith("attn_out.") and t.step is not None)
    layer0 = _pooled(r, "attn_out.layers.0")
    assert not layer0.ok and "gain" in layer0.failed and layer0.gain > tolerance.BF16.max_gain
    j = r.to_json()
    (row,) = [t for t in j["tensors"] if t["name"] == "attn_out.layers.0" and t["step"] is None]
    assert "gain" in row["failed"] and "|gain|" in row["note"] and "gain" in j["tolerance"]["rule"]
    console = Console(file=io.StringIO(), width=250)
    render(r, console)
    assert "NO: gain" in console.file.getvalue() and "attn_out.layers.0 all steps" in console.file.getvalue()


def test_rope_off_by_one_fails_max_and_rel_rms(compare_upstream):
    """Queries rotated one position ahead: attention reads the wrong relative positions, far outside bf16."""
    r = compare_upstream("reimpl.paged_attn", "cmp_single_bf16",
                         engine_factory=engine_factory("reimpl.paged_attn", "rope_query_off_by_one"))
    assert r.exit_code == 1 and not [d for d in r.divergences if d.kind != "tokens"]
    step1 = next(t for t in r.tensors if (t.name, t.step) == ("attn_out.layers.0", 1))
    assert step1.failed == ["max_abs"] and step1.max_abs > 10 * tolerance.BF16.atol
    assert "rel_rms" in _pooled(r, "attn_out.layers.0").failed


# --- the top-5 rule on real runs: a logit pushed up at one position ---------------------------


def _push_token(monkeypatch, position: int, token: int):
    """The reimpl's logits at output position `position` of cmp_single_bf16 (one request: one row
    per step) get `token` pushed to the top, so its own greedy token there is `token`."""
    orig, calls = Qwen3.logits, []

    def logits(self, hidden):
        out = orig(self, hidden)
        if len(calls) == position:
            out[0, token] = out[0].max() + 1
        calls.append(1)
        return out

    monkeypatch.setattr(Qwen3, "logits", logits)


def _up_top(upstream_run):
    out = json.loads((upstream_run("cmp_single_bf16").run_dir / "outputs.json").read_text())["requests"][0]
    return out["token_ids"], out["top_token_ids"]


def test_a_token_in_upstreams_top5_passes_and_the_reimpl_follows_upstream(compare_upstream, upstream_run, monkeypatch):
    tokens, top = _up_top(upstream_run)
    pos = 4
    second = next(t for t in top[pos] if t != tokens[pos])
    _push_token(monkeypatch, pos, second)
    r = compare_upstream("reimpl.paged_attn", "cmp_single_bf16")
    assert r.exit_code == 0, r.first  # later steps still agree: the reimpl ran on upstream's tokens
    rule = r.tokens["r0"]["top_k_rule"]
    assert (rule["ok"], rule["identical"], rule["first_diff"], rule["reimpl"]) == (True, False, pos, second)
    assert r.tokens["r0"]["reimpl"][pos] == second
    assert any(f"output position {pos}" in n and "continued with upstream's tokens" in n for n in r.notes)
    assert len(r.tensors) == 4 * r.steps_upstream + 4 and all(t.ok for t in r.tensors)


def test_a_token_outside_upstreams_top5_is_a_tokens_divergence(compare_upstream, upstream_run, monkeypatch):
    tokens, top = _up_top(upstream_run)
    pos = 4
    outsider = next(t for t in range(512) if t not in top[pos])
    _push_token(monkeypatch, pos, outsider)
    r = compare_upstream("reimpl.paged_attn", "cmp_single_bf16")
    assert r.exit_code == 1
    assert (r.first.kind, r.first.field, r.first.req_id) == ("tokens", f"outputs[r0].token_ids[{pos}]", "r0")
    assert f"reimpl's {outsider} is not in upstream's top-5" in r.first.message
    assert not r.tokens["r0"]["top_k_rule"]["ok"]


# --- could not run ----------------------------------------------------------------------------


def test_bf16_run_without_top_logprobs_cannot_be_compared(upstream_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(upstream_run("cmp_single_bf16").run_dir, run)
    outs = json.loads((run / "outputs.json").read_text())
    for o in outs["requests"]:
        o.pop("top_token_ids"), o.pop("top_logprobs")
    (run / "outputs.json").write_text(json.dumps(outs))
    with pytest.raises(TourError, match="recorded no top-k logprobs"):
        compare("reimpl.paged_attn", SCENARIOS_DIR / "cmp_single_bf16.toml", upstream_run=run)


def test_a_dtype_the_reimpl_does_not_run_exits_2(tmp_path):
    sc = tmp_path / "half.toml"
    sc.write_text((SCENARIOS_DIR / "cmp_single.toml").read_text().replace("[engine]", '[engine]\ndtype = "float16"'))
    r = CliRunner().invoke(app, ["compare", "reimpl.paged_attn", "--scenario", str(sc)])
    assert isinstance(r.exception, TourError) and r.exception.exit_code == 2
    assert "dtype float16 (the reimpl runs float32 or bfloat16)" in str(r.exception)


# --- the Triton kernel in bf16 (its own process: Triton's interpreter is chosen at import) -----


def test_triton_kernel_in_bf16_matches_upstream(tmp_path, upstream_run):
    upstream_run("cmp_single_bf16")  # the shared cache: the subprocess reuses this run
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "vllm_tour", "compare", "reimpl.triton_attn", "--scenario",
                        str(SCENARIOS_DIR / "cmp_single_bf16.toml"), "--json", str(out)],
                       capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())["scenarios"][0]
    assert res["tolerance"]["name"] == "bf16" and res["tensor_summary"]["compared"] == 48 + 4  # + pooled rows
    assert res["dtype"] == "bfloat16" and all(t["ok"] for t in res["tensors"]) and res["tokens"]["r0"]["top_k_rule"]["ok"]
