"""How many top logprobs a low-precision run records at each generated position.

Upstream records them (upstream_run asks vLLM for them), the reimpl records its own
(compare), and vLLM's top-k token rule compares the two (compare.tokens). Standard
library only: the GPU runner imports it on a machine without pydantic.
"""

TOP_K = 5  # vLLM's own tests (check_logprobs_close) use 5 too


def default_logprobs(dtype: str) -> int:
    """Top-k logprobs to record for a run in `dtype`: none in fp32 (tokens compare exactly there)."""
    return 0 if dtype in ("float32", "float") else TOP_K
