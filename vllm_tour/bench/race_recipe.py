"""nano-vllm's throughput recipe, shared by both sides of the race (pure Python, no deps).

256 sequences; prompt lengths and output lengths uniform in 100..1024 with
`random.seed(0)`; prompt tokens uniform in 0..10000; every request runs to
max_tokens (ignore_eos). The draw order is nano-vllm's bench.py (and
shared/gpu/cuda-engine/bench_upstream.py): all prompts first, then all
output lengths. With n=256 that is 133,966 output tokens.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "data" / "qwen3-0.6b-config.json"
NUM_SEQS = 256
TEMPERATURE = 0.6
MAX_MODEL_LEN = 4096
EXPECTED_OUTPUT_TOKENS = {256: 133_966}


def recipe(n: int = NUM_SEQS, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids per sequence, max_tokens per sequence)."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(n)]
    max_tokens = [random.randint(100, 1024) for _ in range(n)]
    return prompts, max_tokens


def model_config() -> dict:
    return json.loads(CONFIG.read_text())


def upstream_engine_kwargs(backend: str, eager: bool) -> dict:
    """Upstream's engine on this recipe (the race's upstream side, the overhead bench on the GPU): Qwen3-0.6B's
    config alone in a model directory, dummy weights, bf16, no tokenizer, the attention backend asked for."""
    model_dir = Path(tempfile.gettempdir()) / "vllm-tour-q06"
    model_dir.mkdir(exist_ok=True)
    shutil.copy(CONFIG, model_dir / "config.json")
    return dict(model=str(model_dir), load_format="dummy", dtype="bfloat16", enforce_eager=eager,
                max_model_len=MAX_MODEL_LEN, skip_tokenizer_init=True, gpu_memory_utilization=0.8,
                attention_config={"backend": backend})
