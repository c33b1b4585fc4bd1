"""Upstream's side of the race: vLLM's offline engine on nano-vllm's recipe.

    PYTHONPATH=/tmp/vllm-cuda:. python -m vllm_tour.bench.race_upstream eager|graphs [--backend FLASH_ATTN] [--num-seqs N]

As shared/gpu/cuda-engine/bench_upstream.py: Qwen3-0.6B shapes with dummy
weights, bf16, max_model_len 4096, gpu_memory_utilization 0.8, in-process
engine core, no tokenizer; `--backend` is the attention backend asked for
(FLASH_ATTN, upstream's default on Hopper, which runs FlashAttention 3 there;
or TRITON_ATTN); `graphs` is upstream's default (torch.compile + CUDA graphs),
`eager` is `enforce_eager=True`. Throughput = output tokens / wall time of the
whole `generate` call. Prints one JSON line starting with `RACE `, which also
says what upstream reported it used (its config, and its log lines that name
the attention backend, the FlashAttention version or CUDA graphs).
"""

import argparse
import json
import logging
import os
import re
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_tour.bench.race_recipe import NUM_SEQS, TEMPERATURE, recipe, upstream_engine_kwargs  # noqa: E402

REPORTED = re.compile(r"backend|flash.?attn|flashattention|cuda ?graph|cudagraph|torch\.compile", re.IGNORECASE)
MAX_REPORTED_LINES = 12


class Reported(logging.Handler):
    """vLLM's own log lines about the attention backend, FlashAttention and graphs (what it says it used)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if REPORTED.search(msg) and len(self.lines) < MAX_REPORTED_LINES:
            self.lines.append(msg[:300])


def flash_attn_version():
    """The FlashAttention version vLLM picks on this GPU by default (3 on Hopper), or why it could not say."""
    why = []
    for mod in ("vllm.v1.attention.backends.fa_utils", "vllm.attention.utils.fa_utils"):
        try:
            return __import__(mod, fromlist=["get_flash_attn_version"]).get_flash_attn_version()
        except Exception as e:  # noqa: BLE001 - a figure's context, recorded with the reason, never fatal
            why.append(f"{mod}: {type(e).__name__}: {e}"[:200])
    return {"unknown": why}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("eager", "graphs"))
    ap.add_argument("--backend", default="FLASH_ATTN", help="attention backend asked for (attention_config)")
    ap.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    a = ap.parse_args()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reported = Reported()
    logging.getLogger("vllm").addHandler(reported)
    t0 = time.time()
    llm = LLM(**upstream_engine_kwargs(a.backend, eager=(a.mode == "eager")))
    init_s = time.time() - t0
    print("init", round(init_s, 1), flush=True)
    prompts, max_tokens = recipe(a.num_seqs)
    tps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(tps, params, use_tqdm=False)
    dt = time.perf_counter() - t
    tot = sum(len(o.outputs[0].token_ids) for o in outs)
    cfg = llm.llm_engine.vllm_config
    cc = cfg.compilation_config
    print("RACE " + json.dumps({
        "side": "upstream", "mode": a.mode, "backend": a.backend, "num_seqs": a.num_seqs, "output_tokens": tot,
        "seconds": round(dt, 3), "tok_per_s": round(tot / dt, 1), "init_s": round(init_s, 1),
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "vllm": vllm.__version__, "torch": torch.__version__,
        "upstream_reported": {"attention_config_backend": str(getattr(getattr(cfg, "attention_config", None), "backend", None)),
                              "flash_attn_version": flash_attn_version(),
                              "compilation_mode": str(getattr(cc, "mode", None)),
                              "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
                              "enforce_eager": cfg.model_config.enforce_eager,
                              "log": reported.lines}}), flush=True)


if __name__ == "__main__":
    main()
