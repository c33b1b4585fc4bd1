"""Golden traces recorded on the H200 (upstream vLLM 0.21.0, CUDA, TRITON_ATTN, fp32 with
TRITON_F32_DEFAULT=ieee, i.e. upstream's Triton attention dots in true fp32) by
`vllm_tour/gpu/cuda_run.sh --triton-f32 ieee`; the *_bf16 ones in bf16 with top-5 logprobs
(traces/results/20261130-h200-v0.21.0-bf16). They cannot be re-recorded on CPU; what is checked
here: every probe family recorded on CUDA, and the reimpl's decisions and tokens against them."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.trace.reader import load_run

V0210 = GOLDEN_DIR / "v0.21.0"
NAMES = ("single", "chunked_prefill", "preemption", "shared_prefix")


@pytest.mark.parametrize("name", NAMES)
def test_cuda_golden_has_every_record_kind(name):
    d = V0210 / name
    meta = json.loads((d / "meta.json").read_text())
    assert meta["pin"] == "v0.21.0" and meta["status"] == "ok"
    assert meta["engine_args"]["attention_config"] == {"backend": "TRITON_ATTN"}
    assert meta["engine_args"]["async_scheduling"] is False
    assert meta["env"] == {"TRITON_F32_DEFAULT": "ieee"}  # kept by write_golden: it decides the numbers
    recs = [json.loads(line) for line in (d / "records.0.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in recs}
    assert kinds == {"scheduler", "kv", "attention", "runner"}  # and no probe_error
    att = next(r for r in recs if r["kind"] == "attention")
    assert att["backend"] == "TritonAttention" and att["layout"] == "[blocks, 2, block_size, kv_heads, head]"
    steps = {k: sorted({r["step"] for r in recs if r["kind"] == k}) for k in kinds}
    assert len({tuple(v) for v in steps.values()}) == 1  # one record of each kind per step
    assert sum(f.stat().st_size for f in d.iterdir()) < 200 << 10
    load_run(d)  # the reader takes it


def _golden_run(tmp_path, name, env: dict | None = None, golden: Path = V0210) -> Path:
    from vllm_tour.upstream.models import resolve_model

    run = tmp_path / name
    shutil.copytree(golden / name, run)
    meta = json.loads((run / "meta.json").read_text())
    meta["model_path"] = str(resolve_model(meta["model"]))  # goldens store "<cache>/…"
    if env is not None:
        meta["env"] = env
    (run / "meta.json").write_text(json.dumps(meta))
    return run


def _compare_golden(tmp_path, name, module="reimpl.chunked_prefill", env=None, golden=V0210, **kw) -> dict:
    from vllm_tour.compare import harness

    return harness.compare(module, harness.SCENARIOS_DIR / f"{name}.toml",
                           upstream_run=_golden_run(tmp_path, name, env, golden), **kw).to_json()


@pytest.mark.parametrize("name", NAMES)
def test_reimpl_matches_upstream_cuda_exactly(tmp_path, name):
    """fp32: reimpl.chunked_prefill (on CPU) vs upstream's CUDA engine with IEEE fp32 attention dots:
    decisions and tokens identical -- shared_prefix's near-tie included."""
    r = _compare_golden(tmp_path, name)
    assert r["status"] == "clean", r["first_divergence"]
    assert "reimpl policy for pin v0.21.0: free_policy=append_all" in r["notes"]


def test_free_policy_is_what_v0210_preemption_needs(tmp_path, monkeypatch):
    """v0.21.0 BlockPool.free_blocks appends every freed block; v0.32.0 prepends the unhashed ones.
    With v0.32.0's policy the reimpl hands out a different block after the first preemption."""
    from vllm_tour.upstream import pins

    profile = pins.pin_profile("v0.21.0").model_copy(update={"free_queue_policy": "uncached_to_front"})
    monkeypatch.setattr(pins, "pin_profile", lambda tag: profile)
    r = _compare_golden(tmp_path, "preemption")
    first = r["first_divergence"]
    assert r["status"] == "diverged" and first["step"] == 61 and first["field"] == "kv.block_tables[r2]"
    assert (first["upstream"], first["reimpl"]) == ([4, 7, 2], [4, 5, 7])


def tf32(x):
    """Cut fp32 to TF32 (10 mantissa bits), as Triton's default fp32 tl.dot feeds NVIDIA tensor cores."""
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def tf32_paged_attention(q, k_new, v_new, cache, meta):
    """reimpl.paged_attn.paged_attention with Q·K and P·V taking TF32 inputs (fp32 accumulation)."""
    cache.write(k_new, v_new, meta.slot_mapping)
    heads, d = q.shape[1], q.shape[2]
    out = torch.empty(q.shape[0], heads * d)
    for i, (table, seq_len) in enumerate(zip(meta.block_tables, meta.seq_lens)):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        k, v = cache.gather(table, seq_len)
        k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
        scores = torch.matmul(tf32(q[start:end].transpose(0, 1)), tf32(k.permute(1, 2, 0))) / math.sqrt(d)
        q_pos = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(tf32(probs), tf32(v.transpose(0, 1))).transpose(0, 1).reshape(end - start, -1)
    return out


def _tf32_engine(cfg):
    from reimpl.engine import Engine
    from reimpl.qwen3 import Qwen3

    return Engine(cfg, model=Qwen3(cfg.model_dir, attention=tf32_paged_attention))


def test_shared_prefix_near_tie_flips_with_tf32(tmp_path):
    """The prefix-hit request's first token: 64 of 90 tokens hit, 26 recomputed at positions 64..89; its top-2
    logits are 6e-4 apart in fp32. Upstream with TF32 attention dots (Triton's default on NVIDIA) sampled 469
    there (the H200 run of 2026-11-29, traces/results/20261129-h200-v0.21.0-probes); with IEEE fp32 dots
    (this golden) it samples 335, as the plain fp32 reimpl does (test above). The reimpl with TF32-emulated
    attention flips the same tie the same way: TF32 explains the whole difference."""
    r = _compare_golden(tmp_path, "shared_prefix", engine_factory=_tf32_engine)
    first = r["first_divergence"]
    assert (first["step"], first["field"]) == (3, "runner.sampled_token_ids[second]")
    assert (first["upstream"], first["reimpl"]) == ([335], [469])
    assert all(d["step"] is None or d["step"] >= 3 for d in r["divergences"])
    assert all(d["field"].startswith("runner.sampled_token_ids") or d["step"] is None or d["step"] > 3
               for d in r["divergences"])


def test_cuda_triton_tolerance_follows_the_recorded_f32_default(tmp_path):
    """The golden recorded TRITON_F32_DEFAULT=ieee: fp32's 1e-5. The same backend without it (Triton's default,
    TF32 dots): 1e-2. --atol/--rtol still win."""
    from vllm_tour.compare import diffs, tolerance

    r = _compare_golden(tmp_path, "single", module="reimpl.paged_attn")
    tol = r["tolerance"]
    assert tol["upstream_attention_backend"] == "TritonAttention"
    assert (tol["atol"], tol["rtol"], tol["name"]) == (1e-5, 1e-5, "fp32") and "TRITON_F32_DEFAULT=ieee" in tol["reason"]
    r = _compare_golden(tmp_path / "tf32", "single", module="reimpl.paged_attn", env={})
    tol = r["tolerance"]
    assert (tol["atol"], tol["rtol"], tol["name"]) == (1e-2, 1e-2, tolerance.TF32_DOTS.name) and "TF32" in tol["reason"]
    r = _compare_golden(tmp_path / "given", "single", module="reimpl.paged_attn", env={}, atol=1e-4)
    assert (r["tolerance"]["atol"], r["tolerance"]["rtol"], r["tolerance"]["name"]) == (1e-4, 1e-2, "given")


def test_tolerance_for_backend_and_env():
    from vllm_tour.compare import diffs, tolerance

    assert tolerance.tolerance_for("CPUAttention") == tolerance.FP32 and tolerance.tolerance_for(None) == tolerance.FP32
    assert tolerance.tolerance_for("CPUAttention", {"TRITON_F32_DEFAULT": "tf32"}) == tolerance.FP32
    assert tolerance.tolerance_for("TritonAttention") == tolerance.TF32_DOTS
    assert tolerance.tolerance_for("TritonAttention", {"TRITON_F32_DEFAULT": "tf32"}) == tolerance.TF32_DOTS
    ieee = tolerance.tolerance_for("TritonAttention", {"TRITON_F32_DEFAULT": "ieee"})
    assert (ieee.atol, ieee.rtol, ieee.name) == (1e-5, 1e-5, "fp32") and ieee == tolerance.FP32_IEEE_DOTS


def test_tf32_tolerance_is_needed_and_enough(compare_upstream):
    """On CPU: the reimpl with TF32-emulated attention vs upstream's fp32 CPU run. fp32's 1e-5 rejects it (so it
    would reject upstream CUDA Triton too); the TF32 tolerance accepts it; decisions stay identical."""
    from vllm_tour.compare import diffs, tolerance

    r = compare_upstream("reimpl.paged_attn", "cmp_chunked", engine_factory=_tf32_engine)
    assert r.tolerance == tolerance.FP32 and not r.divergences and r.bad_tensors
    worst = max(t.max_abs for t in r.tensors)
    assert 1e-3 < worst < tolerance.TF32_DOTS.atol / 2  # observed on the H200: 2.2e-3..3.6e-3
    r = compare_upstream("reimpl.paged_attn", "cmp_chunked", engine_factory=_tf32_engine,
                         atol=tolerance.TF32_DOTS.atol, rtol=tolerance.TF32_DOTS.rtol)
    assert r.clean


BF16_NAMES = ("cmp_chunked_bf16", "cmp_preempt_bf16")


@pytest.mark.parametrize("name", BF16_NAMES)
def test_reimpl_bf16_on_cpu_matches_upstream_cuda_bf16(tmp_path, name):
    """bf16 goldens from the H200 (upstream 0.21.0, TRITON_ATTN, top-5 logprobs recorded): the reimpl in bf16
    on the CPU makes every decision upstream made (on upstream's tokens), and where its own greedy pick first
    differs, both picks are in the other side's top-5 (vLLM's check_logprobs_close)."""
    meta = json.loads((V0210 / name / "meta.json").read_text())
    assert meta["engine_args"]["dtype"] == "bfloat16" and meta["engine_args"]["logprobs"] == 5
    outs = json.loads((V0210 / name / "outputs.json").read_text())
    assert all(len(o["top_token_ids"]) == len(o["token_ids"]) > 0 for o in outs["requests"])
    r = _compare_golden(tmp_path, name)
    assert r["status"] == "clean", r["first_divergence"]
    assert r["tolerance"]["name"] == "bf16"
    assert r["steps"]["upstream"] == r["steps"]["reimpl"] >= 10
    assert r["tokens_rule"].startswith("vLLM's check_logprobs_close")


def test_flash_attn_golden_probes_and_reimpl_bf16(tmp_path):
    """FLASH_ATTN (fa3) on the H200, bf16 (traces/results/20261130-h200-v0.21.0-flash-bf16): its attention
    probe recorded FlashAttention's metadata and KV layout every step, and the CPU bf16 reimpl makes every
    decision upstream made, its own greedy picks within vLLM's top-5 rule."""
    d = V0210 / "flash_attn" / "cmp_chunked_bf16"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["engine_args"]["attention_config"] == {"backend": "FLASH_ATTN"}
    recs = [json.loads(line) for line in (d / "records.0.jsonl").read_text().splitlines()]
    att = [r for r in recs if r["kind"] == "attention"]
    assert {r["backend"] for r in att} == {"FlashAttention"}
    assert {r["layout"] for r in att} == {"[2, blocks, block_size, kv_heads, head]"}
    assert len(att) == len({r["step"] for r in recs if r["kind"] == "scheduler"}) == 10
    r = _compare_golden(tmp_path, "cmp_chunked_bf16", golden=V0210 / "flash_attn")
    assert r["status"] == "clean", r["first_divergence"]
    assert r["tolerance"]["name"] == "bf16" and r["tolerance"]["upstream_attention_backend"] == "FlashAttention"
