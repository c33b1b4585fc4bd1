"""What every proof shares: the failure it raises, the run's scheduled steps, the evidence line."""

from __future__ import annotations

from vllm_tour.trace.reader import Run


class ClaimFailed(Exception):
    def __init__(self, step: int | None, evidence: str):
        super().__init__(evidence)
        self.step = step
        self.evidence = evidence


SHOWN = 2  # instances of a behaviour quoted as evidence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_size(run: Run) -> int:
    return run.meta.engine_args["block_size"]


def _sched_steps(run: Run):
    return [s for s in run.steps if s.scheduler is not None and s.kv is not None]


def _tokens(run: Run, req_id: str) -> list[int]:
    """Prompt + generated token ids of a request."""
    out = {o.req_id: o for o in run.outputs.requests} if run.outputs else {}
    o = out[req_id]
    return list(o.prompt_token_ids) + list(o.token_ids)


def _need(cond: bool, step: int | None, evidence: str) -> None:
    if not cond:
        raise ClaimFailed(step, evidence)


def _shown(found: list[str], what: str) -> str:
    """The evidence line, or a failure when the run never showed the behaviour at all."""
    _need(bool(found), None, f"the run never shows {what}")
    found = list(dict.fromkeys(found))
    more = f" (+{len(found) - SHOWN} more)" if len(found) > SHOWN else ""
    return "; ".join(found[:SHOWN]) + more


def _first_scheduled(run: Run) -> dict[str, int]:
    first: dict[str, int] = {}
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            first.setdefault(e.req_id, s.index)
    return first

