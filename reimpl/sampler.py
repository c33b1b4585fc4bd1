"""Turning the last position's logits into the next token.

Upstream counterpart (v0.32.0): `vllm.v1.sample.sampler.Sampler.forward`
(greedy path: argmax of the logits; random path on CPU:
`vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler.forward_cpu`, which
draws Gumbel noise in a C++ op, `fused_gumbel_argmax`).

Greedy (temperature 0) is exact. Random sampling here is the textbook
Gumbel-max trick with a per-request torch.Generator; it is *not* bit-identical
to the C++ op, so `compare` forces upstream's tokens for such requests.
"""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def sample(self, req_id: str, logits: torch.Tensor, temperature: float, seed: int | None) -> int:
        if temperature <= 0.0:
            return int(torch.argmax(logits).item())  # ties: lowest token id, as upstream
        gen = self.generators.get(req_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed if seed is not None else 0)
            self.generators[req_id] = gen
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p (the Gumbel-max trick)
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int(torch.argmax(probs / noise).item())
