"""A request as the scheduler and KV-cache manager see it.

Upstream counterpart (v0.32.0): `vllm.v1.request.Request` (fields
`num_computed_tokens`, `_all_token_ids`, `block_hashes`, `status`,
`num_preemptions`, `spec_token_ids`, `num_tokens_with_spec`) and `vllm.v1.request.RequestStatus`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

WAITING = "WAITING"
RUNNING = "RUNNING"
PREEMPTED = "PREEMPTED"
FINISHED_STOPPED = "FINISHED_STOPPED"  # hit EOS / a stop token
FINISHED_LENGTH = "FINISHED_LENGTH_CAPPED"  # hit max_tokens or max_model_len


@dataclass(eq=False)  # identity equality: two requests are never "the same"
class Request:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    eos_token_id: int | None = None  # None: never stop on EOS (ignore_eos)
    arrival_step: int = 0

    status: str = WAITING
    # How many of all_token_ids already have their K/V in the cache. The
    # scheduler's whole job is to let this catch up with num_tokens.
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Chained hashes of every *full* block of all_token_ids (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    # Async scheduling only (reimpl/async_scheduler.py): tokens scheduled to be sampled by steps whose
    # results have not come back yet. Always 0 with the plain Scheduler.
    num_output_placeholders: int = 0
    # Speculative decoding only (spec_decode.py): draft tokens proposed after the last step, run through the
    # model with the request's last token in the next one. Always [] with the plain Scheduler.
    spec_token_ids: list[int] = field(default_factory=list)
    # Set by the KV-cache manager: recomputes block_hashes as tokens are added.
    block_hasher: Callable[["Request"], list[bytes]] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        # Prompt + generated. A resumed (preempted) request must recompute all
        # of these, which is why the scheduler uses num_tokens, not the prompt.
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        # What the scheduler tries to run: the known tokens and the drafts that extend them.
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.startswith("FINISHED")

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        # Upstream Request.append_output_token_ids -> update_block_hashes:
        # a generated token may complete a block, which then gets a hash.
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))
