"""Draft models for speculative decoding, generated from a seed the way the tiny target is (models.py).

A scenario names its draft in `[engine.extra] speculative_config.model`: `tiny-qwen3` (the target as its own
draft, method draft_model) or one of DRAFT_HEADS, a head for tiny-qwen3 in the checkpoint layout upstream's loader
reads. `resolve_draft` puts the directory's path there before the engine starts (engine.run.engine_kwargs); the
weights are written on first use, never committed.

The heads' weights are random: they draft tokens the target rarely agrees with (the point is what the engine
does with drafts, not how good they are). Upstream's classes (vllm 0.32.0, model_executor/models/):

- `tiny-qwen3-eagle`: llama_eagle.EagleLlamaForCausalLM. One Llama decoder layer without its input norm;
  `fc` maps [embedding of the token, target's hidden state] (2h) to h. Embedding and LM head: the target's.
- `tiny-qwen3-eagle3`: llama_eagle3.Eagle3LlamaForCausalLM. One layer (`midlayer`) whose attention reads 2h
  ([normed embedding, normed hidden]); `fc` maps three of the target's hidden states (3h: its embedding's output
  and each layer's, ids 0, 1, 2 in eagle_config: upstream's default ids (2, 1, -1) find only two in a 2-layer
  target, and fc's reshape to 3h failed) to h; its own norm and LM head.
- `tiny-qwen3-medusa`: medusa.Medusa. Three heads, each a residual SiLU block (h -> h) and an LM head; head i
  drafts the token i + 1 places ahead from the target's last hidden state.

MTP drafts with layers inside the target's own checkpoint: its target, `tiny-mimo-mtp`, is a model of its own
(models.make_mtp_target).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vllm_tour.errors import TourError
from vllm_tour.paths import cache_dir
from vllm_tour.upstream.models import (CONFIGS, GENERATOR_VERSION, TINY_MODELS, SeededStream, built_in_place,
                                       make_tiny_model, seeded_linear)

TARGET = "tiny-qwen3"
# name -> (seed, upstream architecture); each head's seed is its own, so no head repeats the target's numbers
DRAFT_HEADS = {
    "tiny-qwen3-eagle": (1, "EagleLlamaForCausalLM"),
    "tiny-qwen3-eagle3": (2, "Eagle3LlamaForCausalLM"),
    "tiny-qwen3-medusa": (3, "MedusaModel"),
}
MEDUSA_HEADS = 3
EAGLE3_AUX_LAYERS = [0, 1, 2]  # the target's hidden states after its embedding, layer 0 and layer 1
# Bump when a head changes: it names their cache directories (with models.GENERATOR_VERSION)
DRAFT_VERSION = 2


def _llama_layer(s: SeededStream, p: str, cfg: dict, attn_in: int) -> dict[str, np.ndarray]:
    h, hd, nh, nkv, inter = (cfg[k] for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                                               "intermediate_size"))
    return {
        p + "self_attn.q_proj.weight": seeded_linear(s, nh * hd, attn_in, 2.0),
        p + "self_attn.k_proj.weight": seeded_linear(s, nkv * hd, attn_in, 2.0),
        p + "self_attn.v_proj.weight": seeded_linear(s, nkv * hd, attn_in, 1.0),
        p + "self_attn.o_proj.weight": seeded_linear(s, h, nh * hd, 1.0),
        p + "mlp.gate_proj.weight": seeded_linear(s, inter, h, 1.0),
        p + "mlp.up_proj.weight": seeded_linear(s, inter, h, 1.0),
        p + "mlp.down_proj.weight": seeded_linear(s, h, inter, 1.0),
        p + "post_attention_layernorm.weight": np.ones(h, np.float32),
    }


def head_config_and_weights(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    """The head's config.json and its tensors, in the names upstream's load_weights reads."""
    seed, arch = DRAFT_HEADS[name]
    t = CONFIGS[TARGET]
    h, v = t["hidden_size"], t["vocab_size"]
    s = SeededStream(seed)
    if arch == "MedusaModel":
        cfg = {"model_type": "medusa", "architectures": [arch], "hidden_size": h, "vocab_size": v,
               "num_heads": MEDUSA_HEADS, "num_hidden_layers": 1, "torch_dtype": "float32"}
        w = {}
        for i in range(MEDUSA_HEADS):
            w[f"blocks.{i}.layers.0.weight"] = seeded_linear(s, h, h, 1.0)
            w[f"lm_heads.{i}.weight"] = seeded_linear(s, v, h, 8.0)
        return cfg, w
    llama = {k: t[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                               "rope_theta", "tie_word_embeddings", "hidden_act", "torch_dtype")}
    cfg = {**llama, "model_type": "llama", "architectures": [arch], "num_hidden_layers": 1, "attention_bias": False,
           "mlp_bias": False}
    if arch == "EagleLlamaForCausalLM":
        w = _llama_layer(s, "layers.0.", cfg, h)
        w["fc.weight"] = seeded_linear(s, h, 2 * h, 1.0)
        return cfg, w
    # 0.21.0 reads the ids at the config's top level only (gpu_model_runner.py:5041); later releases look
    # there first, then in eagle_config
    cfg.update(draft_vocab_size=v, eagle_aux_hidden_state_layer_ids=EAGLE3_AUX_LAYERS,
               eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS})
    w = _llama_layer(s, "midlayer.", cfg, 2 * h)
    w["midlayer.input_layernorm.weight"] = np.ones(h, np.float32)
    w["midlayer.hidden_norm.weight"] = np.ones(h, np.float32)
    w["fc.weight"] = seeded_linear(s, h, len(EAGLE3_AUX_LAYERS) * h, 1.0)
    w["norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = seeded_linear(s, v, h, 8.0)
    return cfg, w


def _cache_dir(name: str) -> Path:
    return cache_dir() / "models" / f"{name}-g{GENERATOR_VERSION}-d{DRAFT_VERSION}"


def make_draft_head(name: str) -> Path:
    """Generate (or reuse) a draft head's directory in the model cache."""
    if name not in DRAFT_HEADS:
        raise TourError(f"unknown draft head '{name}' (known: {', '.join(DRAFT_HEADS)})")
    dest = _cache_dir(name)
    if (dest / "model.safetensors").exists():
        return dest
    from safetensors.numpy import save_file

    cfg, weights = head_config_and_weights(name)
    with built_in_place(dest, name) as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dest


def resolve_draft(spec: dict) -> dict:
    """speculative_config with a draft named by vllm-tour (a tiny model, a draft head) as its directory's path;
    any other value passes as given."""
    model = spec.get("model")
    if model in TINY_MODELS:
        return {**spec, "model": str(make_tiny_model(model))}
    if model in DRAFT_HEADS:
        return {**spec, "model": str(make_draft_head(model))}
    return spec
