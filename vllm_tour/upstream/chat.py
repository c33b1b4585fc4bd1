"""`trace --chat`: each prompt as one user turn of the model's chat template, as a chat front end sends it.

That is how users send "hello" to Qwen3: `<|im_start|>user\\nhello<|im_end|>\\n<|im_start|>assistant\\n`
(thinking mode, Qwen3's default). The templated text becomes the request's prompt, so meta.json shows
exactly what the engine was given, and its special tokens become their ids when the engine tokenizes it.
"""

from __future__ import annotations

from vllm_tour.errors import TourError
from vllm_tour.scenario import Scenario


def chat_tokenizer(model_dir):
    """The model's tokenizer, as vLLM loads it (transformers), refused when it has no chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if not tok.chat_template:
        raise TourError(f"--chat: the model in {model_dir} has no chat template (tokenizer_config.json chat_template)")
    return tok


def chat_text(tok, user_text: str) -> str:
    """One user message through the chat template, with the assistant's turn opened."""
    return tok.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True)


def apply_chat(scenario: Scenario) -> Scenario:
    """The scenario with every text prompt in chat form (requests given as token ids are left as they are)."""
    from vllm_tour.upstream.models import resolve_model

    tok = chat_tokenizer(resolve_model(scenario.model, scenario.engine.load_format))
    requests = [r.model_copy(update={"prompt": chat_text(tok, r.prompt)}) if r.prompt is not None else r
                for r in scenario.requests]
    return scenario.model_copy(update={"requests": requests})
