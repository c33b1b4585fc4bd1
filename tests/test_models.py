"""The embedded tiny checkpoints: byte-identical everywhere, loadable, not degenerate."""

import json
import subprocess
import sys

import pytest

from vllm_tour.upstream import models
from vllm_tour.errors import TourError

# Pinned: a change here means every golden trace and comparison changes too.
DIGESTS = {
    "tiny-qwen3": "395f8faa9b46fa596e07aa948af5ce822ee7357b9ed4c817aee25148f81e8710",
    "tiny-qwen3-moe": "be75f127ae2b576e2bbd18bbece5241518024f83cd06a32c77d7d9299bc108c9",
    "tiny-qwen3-tp": "5ee306a73d23af21ef637d4a05b0ac3aa7b7cbdae200e74a30987ec703641cb7",
}


@pytest.mark.parametrize("name", models.TINY_MODELS)
def test_fresh_generation_matches_pinned_digest(name, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TOUR_CACHE", str(tmp_path))
    path = models.make_tiny_model(name)
    assert path.is_relative_to(tmp_path)
    assert models.model_digest(path) == DIGESTS[name]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head_dim"] == 64  # what vLLM's CPU attention supports


def test_generation_is_atomic_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TOUR_CACHE", str(tmp_path))
    first = models.make_tiny_model("tiny-qwen3")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert models.make_tiny_model("tiny-qwen3") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    # no temp directories left beside the model
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_greedy_decoding_is_not_one_repeated_token():
    """transformers' reference forward on the tiny model wanders: the weights'
    scale is what makes traces and comparisons informative."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.resolve_model("tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok("hello", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(set(out)) > 8, out


def test_tokenizer_round_trips_english_and_chinese():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.resolve_model("tiny-qwen3"))
    for text in ["hello world", "调度器决定每一步运行哪些请求。"]:
        assert tok.decode(tok(text).input_ids) == text
    assert tok.eos_token == "<|endoftext|>"


def test_real_model_name_not_in_cache_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(TourError) as e:
        models.resolve_model("Qwen3-0.6B")
    msg = str(e.value)
    assert "models--Qwen--Qwen3-0.6B" in msg and "tiny-qwen3" in msg and "\n" not in msg


def test_real_model_name_resolves_from_hf_cache(tmp_path, monkeypatch):
    snap = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert models.resolve_model("Qwen/Qwen3-0.6B") == snap
    assert models.resolve_model("Qwen3-0.6B") == snap


def test_models_make_cli_prints_path_and_digest(tmp_path):
    env = {"VLLM_TOUR_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "vllm_tour", "models", "make", "tiny-qwen3"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert DIGESTS["tiny-qwen3"] in r.stdout.replace("\n", "")
    r = subprocess.run([sys.executable, "-m", "vllm_tour", "models", "make", "tiny-llama"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "tiny-llama" in r.stderr
