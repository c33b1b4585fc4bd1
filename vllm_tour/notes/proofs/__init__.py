"""Checks that prove the notes' claims on a live upstream trace (`vllm-tour annotations verify`).

Each check takes a loaded run (`trace.reader.Run`) and returns its evidence as one line; when the claim does not
hold it raises `ClaimFailed` with the step and what was seen there. Checks read only the trace records (scheduler,
kv, runner, attention) and the run's meta (engine arguments, prompt token ids, outputs):
annotations/proofs/<pin>.toml says which note each one proves, on which scenario. One module per subject:
block_pool (the free queue replayed: a block handed out is "hashless" when it was freed while partly filled,
"fresh" when never used, "cached" when freed full), prefix_cache, scheduler, chunking, admission, serving (on a
`vllm-tour serve` run: the front end's records against the engine's), spec_decode (ngram drafts: proposed,
verified, rolled back).
"""

from types import ModuleType

from vllm_tour.notes.proofs import admission, block_pool, chunking, prefix_cache, scheduler, serving, spec_decode
from vllm_tour.notes.proofs._common import ClaimFailed

MODULES: tuple[ModuleType, ...] = (block_pool, prefix_cache, scheduler, chunking, admission, serving, spec_decode)

__all__ = ["ClaimFailed", "MODULES"]
