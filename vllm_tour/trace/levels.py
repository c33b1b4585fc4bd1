"""Trace levels: a run records what its question needs, and says which level it was recorded at.

    steps   which requests ran in each step, their token counts, queue lengths, preemptions (with the
            blocks each lost and why) and finishes: the step table, waiting and preemption questions
    blocks  + the KV record of every step: block tables, allocations, frees, evictions, prefix-cache
            hits, free blocks: the block grid, prefix-cache questions, the notes' proofs
    full    + the model runner's inputs, the attention metadata and the TP/MoE records: what `compare`
            and tensor captures need

A lower level's records are the higher level's with whole record kinds left out (same fields, same
values): a probe a level does not keep is not installed at all, so it costs nothing.
Standard library only: the GPU runner reads it on a machine without pydantic.
"""

from __future__ import annotations

from vllm_tour.errors import TourError

LEVELS = ("steps", "blocks", "full")
LEVEL_ENV = "VLLM_TOUR_LEVEL"  # set by the driver for every vLLM process; unset: full (benchmarks, old drivers)
DEFAULT_LEVEL = "blocks"  # see README "Trace levels": the block grid for about the cost of the step table


def rank(level: str) -> int:
    return LEVELS.index(level)


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise TourError(f"--level {level!r}: choose one of {', '.join(LEVELS)}")
    return level


def has(recorded: str, needed: str) -> bool:
    """A run recorded at `recorded` holds the records of level `needed`."""
    return rank(recorded) >= rank(needed)


def require(recorded: str, needed: str, what: str, run_name: str) -> None:
    """One line when `what` needs records the run does not hold: which level to record again with."""
    if not has(recorded, needed):
        raise TourError(f"{what} needs records of level {needed}; {run_name} was recorded at level {recorded}: "
                        f"record it again with --level {needed}")


def missing_line(recorded: str, needed: str, what: str) -> str | None:
    """The line a view prints in place of a section the run's level does not hold (None: it does)."""
    if has(recorded, needed):
        return None
    return f"{what}: not recorded at level {recorded} (record again with --level {needed})"
