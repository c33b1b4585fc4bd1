"""Upstream's side of the race: vLLM's offline engine on nano-vllm's recipe.

    PYTHONPATH=/tmp/vllm-cuda:. python3 vllm_tour/bench/race_upstream.py eager|graphs [--num-seqs N]

Same as shared/gpu/cuda-engine/bench_upstream.py (which measured 4,282 tok/s
eager and 15,559 tok/s with CUDA graphs + torch.compile on the H200, vLLM
0.21.0): Qwen3-0.6B shapes with dummy weights, bf16, TRITON_ATTN,
max_model_len 4096, gpu_memory_utilization 0.8, in-process engine core,
no tokenizer. Prints one JSON line starting with `RACE `.
"""

import json
import os
import shutil
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from vllm_tour.bench.race_recipe import CONFIG, MAX_MODEL_LEN, NUM_SEQS, TEMPERATURE, recipe  # noqa: E402


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "eager"
    n = int(sys.argv[sys.argv.index("--num-seqs") + 1]) if "--num-seqs" in sys.argv else NUM_SEQS
    d = "/tmp/q06"
    os.makedirs(d, exist_ok=True)
    shutil.copy(CONFIG, os.path.join(d, "config.json"))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(model=d, load_format="dummy", dtype="bfloat16", enforce_eager=(mode == "eager"),
              max_model_len=MAX_MODEL_LEN, skip_tokenizer_init=True,
              attention_config={"backend": "TRITON_ATTN"}, gpu_memory_utilization=0.8)
    init_s = time.time() - t0
    print("init", round(init_s, 1), flush=True)
    prompts, max_tokens = recipe(n)
    tps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    t = time.time()
    outs = llm.generate(tps, params, use_tqdm=False)
    dt = time.time() - t
    tot = sum(len(o.outputs[0].token_ids) for o in outs)
    sc = llm.llm_engine.vllm_config.scheduler_config
    print("RACE " + json.dumps({"side": "upstream", "mode": mode, "num_seqs": n, "output_tokens": tot,
                                "seconds": round(dt, 3), "tok_per_s": round(tot / dt, 1), "init_s": round(init_s, 1),
                                "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens}),
          flush=True)


if __name__ == "__main__":
    main()
