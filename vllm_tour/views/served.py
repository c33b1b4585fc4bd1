"""The requests of a `vllm-tour serve` run as its records name them: the API id a client got, the engine requests
behind it (one per choice when n > 1), and how an aborted one ended.

A served request has two names. The client sees the API id (`chatcmpl-…`, `cmpl-…`); the engine schedules its
own id (chat: the API id; completions: `<api id>-<prompt index>`; n > 1: one child `<index>_<parent>` per
choice). The front end's records (ServerRequestRecord) tie the two together; the views accept either.
"""

from __future__ import annotations

from vllm_tour.errors import TourError
from vllm_tour.trace.reader import Run
from vllm_tour.trace.schema import AbortRecord, ServerRequestRecord


def engine_request(run: Run, name: str) -> str:
    """The engine request id `name` stands for: itself when the engine ran a request of that id, else the one engine
    request behind the API id `name` (TourError when there is none, or several: n > 1 has one per choice)."""
    if name in run.request_ids():
        return name
    behind = [r.req_id for r in run.server_requests if r.api_id == name]
    if len(behind) == 1:
        return behind[0]
    if behind:
        raise TourError(f"{name} is {len(behind)} engine requests (n = {len(behind)}, one per choice): give one of "
                        f"{', '.join(sorted(behind))}")
    known = ", ".join(run.request_ids())
    apis = sorted({r.api_id for r in run.server_requests} - set(run.request_ids()))
    raise TourError(f"no request {name!r} in {run.path.name} (requests: {known}" + (f"; API ids: {', '.join(apis)}" if apis else "") + ")")


def server_record(run: Run, rid: str) -> ServerRequestRecord | None:
    return next((r for r in run.server_requests if r.req_id == rid), None)


def siblings(run: Run, rec: ServerRequestRecord) -> list[str]:
    """The other engine requests made for the same choices (n > 1), by index."""
    return [r.req_id for r in sorted(run.server_requests, key=lambda r: r.index)
            if r.parent_id == rec.parent_id and r.req_id != rec.req_id]


def abort_of(run: Run, rid: str) -> tuple[int, AbortRecord] | None:
    """The step during which the engine dropped `rid`, and what it dropped (None: it was not aborted)."""
    return next(((s.index, a) for s in run.steps for a in s.aborts if a.req_id == rid), None)


def served_after(run: Run, abort: AbortRecord) -> list[ServerRequestRecord]:
    """The engine requests the server received after the abort: the server was still serving then, so the abort
    was not its shutdown."""
    return [r for r in run.server_requests if r.arrival_time > abort.time]
