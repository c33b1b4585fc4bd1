"""vllm-tour: see what upstream vLLM does, step by step, at a pinned version."""

__version__ = "0.1.0"
