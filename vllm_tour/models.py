"""Models: the embedded tiny checkpoints, and resolving real model names.

The tiny models exist so that every machine runs the *real* upstream engine
on the *same bytes* in seconds, without a model hub:

- weights come from numpy's PCG64 bit stream (its raw output is stable across
  platforms and numpy versions), turned into floats with exact arithmetic, so
  the safetensors files are byte-identical everywhere;
- the tokenizer is a small byte-level BPE checked into the package
  (`data/tokenizer.json`, built once by `python -m vllm_tour.tokenizer_build`);
- shapes suit vLLM's CPU attention backend: head size 64, and every KV block
  size we use is a multiple of 32.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import TourError
from .paths import DATA_DIR, cache_dir

TINY_MODELS = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-tp")
DEFAULT_MODEL = "tiny-qwen3"
# Bump when the generator changes: it names the cache directory, so an old
# checkpoint is never mistaken for a new one.
GENERATOR_VERSION = 1
SEED = 20261129

_COMMON = {
    "vocab_size": 512,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "use_cache": True,
}

CONFIGS = {
    "tiny-qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 512,
    },
    # For tensor parallelism at TP=2: one KV head (so each rank holds a replica of it, not a half) and a
    # vocabulary that is no multiple of 64 (so the embedding and LM head shards carry padding rows).
    "tiny-qwen3-tp": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 512,
        "vocab_size": 500,
        "num_key_value_heads": 1,
    },
    "tiny-qwen3-moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
}


class _Stream:
    """Deterministic uniform floats in [-1, 1) from PCG64's raw 64-bit output."""

    def __init__(self, seed: int):
        self._bits = np.random.PCG64(seed)

    def uniform(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        raw = self._bits.random_raw(n).astype(np.uint64)
        # Top 24 bits -> exact float32 in [0, 1): no rounding differences anywhere.
        u = (raw >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24)
        return (u * np.float32(2.0) - np.float32(1.0)).reshape(shape)


def _linear(stream: _Stream, out_f: int, in_f: int, gain: float) -> np.ndarray:
    # Uniform(-a, a) has std a/sqrt(3); a = gain*sqrt(3/fan_in) gives std gain/sqrt(fan_in).
    a = np.float32(gain * np.sqrt(3.0 / in_f))
    return stream.uniform((out_f, in_f)) * a


def _weights(cfg: dict) -> dict[str, np.ndarray]:
    """HF-layout tensors. Gains are chosen so greedy decoding wanders instead of
    repeating one token (random weights at the usual init scale collapse)."""
    s = _Stream(SEED)
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t: dict[str, np.ndarray] = {}
    t["model.embed_tokens.weight"] = s.uniform((v, h))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "self_attn.q_proj.weight"] = _linear(s, nh * hd, h, 2.0)
        t[p + "self_attn.k_proj.weight"] = _linear(s, nkv * hd, h, 2.0)
        t[p + "self_attn.v_proj.weight"] = _linear(s, nkv * hd, h, 1.0)
        t[p + "self_attn.o_proj.weight"] = _linear(s, h, nh * hd, 1.0)
        t[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
        if cfg["model_type"] == "qwen3_moe":
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = _linear(s, e, h, 4.0)
            for j in range(e):
                q = f"{p}mlp.experts.{j}."
                t[q + "gate_proj.weight"] = _linear(s, mi, h, 1.0)
                t[q + "up_proj.weight"] = _linear(s, mi, h, 1.0)
                t[q + "down_proj.weight"] = _linear(s, h, mi, 1.0)
        else:
            i_sz = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = _linear(s, i_sz, h, 1.0)
            t[p + "mlp.up_proj.weight"] = _linear(s, i_sz, h, 1.0)
            t[p + "mlp.down_proj.weight"] = _linear(s, h, i_sz, 1.0)
    t["model.norm.weight"] = np.ones(h, np.float32)
    t["lm_head.weight"] = _linear(s, v, h, 8.0)
    return t


def tokenizer_json() -> Path:
    return DATA_DIR / "tokenizer.json"


def _special_ids() -> dict[str, int]:
    vocab = json.loads(tokenizer_json().read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in vocab}


def tiny_model_dir(name: str) -> Path:
    return cache_dir() / "models" / f"{name}-g{GENERATOR_VERSION}"


def make_tiny_model(name: str, force: bool = False) -> Path:
    """Generate (or reuse) a tiny checkpoint in HF layout; returns its directory."""
    if name not in CONFIGS:
        raise TourError(f"unknown tiny model '{name}' (known: {', '.join(TINY_MODELS)})")
    dest = tiny_model_dir(name)
    if (dest / "model.safetensors").exists() and not force:
        return dest
    from safetensors.numpy import save_file

    specials = _special_ids()
    eos = specials["<|endoftext|>"]
    cfg = dict(CONFIGS[name], bos_token_id=eos, eos_token_id=eos)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a crash never leaves half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        save_file(_weights(cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        gen = {"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(tokenizer_json(), tmp / "tokenizer.json")
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": cfg["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def model_digest(path: Path) -> str:
    """sha256 over the checkpoint's files (sorted names + bytes)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _hf_cache_roots() -> list[Path]:
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    hf_home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    roots.append(hf_home / "hub")
    return roots


def resolve_model(name: str) -> Path:
    """A model name to a local directory in HF layout.

    `tiny-qwen3` / `tiny-qwen3-moe` are generated on first use. A path is used
    as is. `Qwen3-0.6B` means `Qwen/Qwen3-0.6B`; it is looked up in the local
    Hugging Face cache, since no hub is reachable here.
    """
    if name in TINY_MODELS:
        return make_tiny_model(name)
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise TourError(f"model directory {p} has no config.json")
        return p
    repo = name if "/" in name else f"Qwen/{name}"
    looked = []
    for root in _hf_cache_roots():
        snaps = root / f"models--{repo.replace('/', '--')}" / "snapshots"
        looked.append(str(snaps))
        if snaps.is_dir():
            for snap in sorted(snaps.iterdir()):
                if (snap / "config.json").exists():
                    return snap
    raise TourError(
        f"model '{name}' not found: not a local path, and not in the HF cache "
        f"({'; '.join(looked)}); no model hub is reachable here — try --model tiny-qwen3"
    )
