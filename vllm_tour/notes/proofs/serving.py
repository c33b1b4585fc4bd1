"""Proofs on the serving path, over a `vllm-tour serve` run: the front end's view of each request
(`run.server_requests`, the API server's records) against the EngineCore's (scheduler, KV, abort and runner
records). An offline run has no front-end records, so every check here fails on one, naming what it lacks.

The run is one a client drove (README "Trace a running server"; tests/test_serve.py's `served` fixture): an
`n = 2` completion, a stream the client closes early, a completion cut by a stop string, and `--level full`
for the runner's sampled tokens.
"""

from __future__ import annotations

from vllm_tour.notes.proofs._common import _first_scheduled, _need, _sched_steps, _shown
from vllm_tour.trace.reader import Run


def _engine_tokens(run: Run) -> dict[str, list[int]]:
    """Request -> the token ids the engine sampled for it, step by step (the runner records, rank 0)."""
    out: dict[str, list[int]] = {}
    for s in run.steps:
        rec = s.runner.get(0)
        if rec is not None:
            for rid, ids in rec.sampled_token_ids.items():
                out.setdefault(rid, []).extend(ids)
    return out


def _aborts(run: Run) -> dict[str, tuple[int, object]]:
    """Engine request -> (step, its abort record)."""
    return {a.req_id: (s.index, a) for s in run.steps for a in s.aborts}


def _tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


def _client_aborted(run: Run):
    """The requests whose client hung up: the front end ended them with finish reason `abort`."""
    return [r for r in run.server_requests if r.finish_reason == "abort"]


def n_children_named_after_parent(run: Run) -> str:
    """`n > 1`: the engine gets n requests "<index>_<parent id>" and never the parent itself."""
    scheduled = _first_scheduled(run)
    by_parent: dict[str, list] = {}
    for r in run.server_requests:
        if r.parent_id is not None:
            by_parent.setdefault(r.parent_id, []).append(r)
    found = []
    for parent, kids in by_parent.items():
        kids.sort(key=lambda r: r.index)
        n = kids[0].n
        _need([k.index for k in kids] == list(range(n)), None,
              f"{kids[0].api_id}: n = {n} but the front end made children {[k.index for k in kids]}")
        for k in kids:
            _need(k.req_id == f"{k.index}_{parent}", None,
                  f"{k.api_id}: child {k.index} is {k.req_id}, not {k.index}_{parent}")
            _need(k.req_id in scheduled, None, f"{k.api_id}: child {k.req_id} never scheduled")
        _need(parent not in scheduled, scheduled.get(parent), f"{kids[0].api_id}: the parent {parent} was scheduled")
        found.append(f"{kids[0].api_id} (n = {n}): engine requests "
                     + ", ".join(f"{k.req_id} (first scheduled at step {scheduled[k.req_id]})" for k in kids)
                     + f"; the parent {parent} never scheduled")
    return _shown(found, "a request with n > 1")


def client_close_is_an_engine_abort(run: Run) -> str:
    """A client that hangs up mid-stream: the front end ends the request with `abort`, and the EngineCore drops
    it (an abort record) while it was still running."""
    aborts = _aborts(run)
    found = []
    for r in _client_aborted(run):
        _need(r.req_id in aborts, None, f"{r.api_id}: the client saw abort after {_tokens(len(r.token_ids))}, "
              f"but the engine recorded no abort of {r.req_id}")
        step, a = aborts[r.req_id]
        _need(a.status_before == "RUNNING", step, f"{r.api_id}: dropped at step {step} while {a.status_before}")
        found.append(f"{r.api_id}: the client saw abort after {_tokens(len(r.token_ids))}; the engine dropped "
                     f"{r.req_id} at step {step} while RUNNING, with {_tokens(a.num_output_tokens)} of output")
    return _shown(found, "a request whose client hung up (front-end finish reason abort)")


def aborted_blocks_freed_next_step(run: Run) -> str:
    """An aborted request's blocks are free at once: the next step lists it finished, its blocks in kv.freed and
    it holds no block table any more."""
    steps = _sched_steps(run)
    found = []
    for s in run.steps:
        for a in s.aborts:
            nxt = next((x for x in steps if x.index > s.index), None)
            if nxt is None or not a.freed_block_ids:
                continue  # aborted after the last step (nothing ran after it), or it held no block of its own
            _need(a.req_id in nxt.scheduler.finished, nxt.index,
                  f"{a.req_id}, aborted at step {s.index}, not among step {nxt.index}'s finished {nxt.scheduler.finished}")
            missing = sorted(set(a.freed_block_ids) - set(nxt.kv.freed))
            _need(not missing, nxt.index, f"{a.req_id}'s blocks {missing}, freed at its abort (step {s.index}), "
                  f"not in step {nxt.index}'s kv.freed {nxt.kv.freed}")
            _need(not nxt.kv.block_tables.get(a.req_id), nxt.index,
                  f"{a.req_id} still holds {nxt.kv.block_tables.get(a.req_id)} at step {nxt.index}")
            found.append(f"{a.req_id} aborted at step {s.index} holding {a.block_ids}: step {nxt.index} lists it "
                         f"finished and frees {a.freed_block_ids}")
    return _shown(found, "an aborted request holding blocks with a step after its abort")


def front_end_tokens_are_engine_tokens(run: Run) -> str:
    """A request that ends on its own (length, EOS): the tokens the front end got are the tokens the engine
    sampled, in order, none lost or added."""
    engine = _engine_tokens(run)
    found = []
    for r in run.server_requests:
        if r.finish_reason not in ("length", "stop") or isinstance(r.stop_reason, str) or r.req_id not in engine:
            continue  # a stop string ends it in the front end; no runner records without --level full
        _need(engine[r.req_id] == list(r.token_ids), None,
              f"{r.api_id}: the engine sampled {engine[r.req_id]}, the front end got {list(r.token_ids)}")
        found.append(f"{r.req_id} ({r.finish_reason}): {_tokens(len(r.token_ids))}, the same in the runner's "
                     f"records and at the front end")
    return _shown(found, "a request that ended on its own with the runner's sampled tokens recorded "
                         "(a serve run at --level full)")


def stop_string_is_an_engine_abort(run: Run) -> str:
    """A stop string found by the front end's detokenizer: the client sees `stop` (the string as stop_reason),
    the EngineCore records an abort of the same request."""
    aborts = _aborts(run)
    found = []
    for r in run.server_requests:
        if r.finish_reason != "stop" or not isinstance(r.stop_reason, str):
            continue
        _need(r.req_id in aborts, None, f"{r.api_id}: the client saw stop on {r.stop_reason!r}, "
              f"but the engine recorded no abort of {r.req_id}")
        step, a = aborts[r.req_id]
        found.append(f"{r.api_id}: the client saw stop on {r.stop_reason!r} after {_tokens(len(r.token_ids))}; "
                     f"the engine aborted {r.req_id} at step {step} (with {_tokens(a.num_output_tokens)} of output)")
    return _shown(found, "a request ended by a stop string")


def stop_string_ends_a_running_request(run: Run) -> str:
    """A stop string ends the request in the front end while the EngineCore still runs it: the engine's abort
    record shows it RUNNING (a request the core had finished itself would not be aborted), and the tokens the
    client got are the first of those the engine sampled for it (the stop ends the text, not the engine's run)."""
    aborts, engine = _aborts(run), _engine_tokens(run)
    found = []
    for r in run.server_requests:
        if r.finish_reason != "stop" or not isinstance(r.stop_reason, str):
            continue
        _need(r.req_id in aborts, None, f"{r.api_id}: the client saw stop on {r.stop_reason!r}, "
              f"but the engine recorded no abort of {r.req_id}")
        step, a = aborts[r.req_id]
        _need(a.status_before == "RUNNING", step,
              f"{r.api_id}: stopped on {r.stop_reason!r} in the front end, aborted at step {step} while {a.status_before}")
        if r.req_id not in engine:
            continue  # no runner records (a serve run below --level full)
        kept, sampled = list(r.token_ids), engine[r.req_id]
        _need(kept and sampled[:len(kept)] == kept, None,
              f"{r.api_id}: the client got {kept}, not a prefix of the engine's {sampled}")
        found.append(f"{r.api_id}: stop on {r.stop_reason!r} after {_tokens(len(kept))} (the engine's first "
                     f"{len(kept)} of {len(sampled)}); the engine still had {r.req_id} RUNNING and aborted it at step {step}")
    return _shown(found, "a request ended by a stop string with the runner's sampled tokens recorded "
                         "(a serve run at --level full)")


def aborted_output_dropped(run: Run) -> str:
    """After the client hangs up, or the front end finds a stop string, the engine samples on until the abort
    reaches it; the front end drops those tokens: what it kept is a prefix of what the engine sampled, shorter by
    at least one token for some client-aborted request. A stop-string request's kept tokens are a prefix too."""
    engine = _engine_tokens(run)
    found, stopped = [], []
    for r in run.server_requests:
        by_stop_string = r.finish_reason == "stop" and isinstance(r.stop_reason, str)
        if (r.finish_reason != "abort" and not by_stop_string) or r.req_id not in engine:
            continue
        sampled, kept = engine[r.req_id], list(r.token_ids)
        _need(sampled[:len(kept)] == kept, None,
              f"{r.api_id}: the front end kept {kept}, not a prefix of the engine's {sampled}")
        if by_stop_string:
            stopped.append(f"{r.req_id} (stop string {r.stop_reason!r}): the engine sampled "
                           f"{_tokens(len(sampled))}, the front end kept the first {len(kept)}")
        elif len(sampled) > len(kept):
            found.append(f"{r.req_id}: the engine sampled {_tokens(len(sampled))}, the front end kept the first "
                         f"{len(kept)} and dropped {len(sampled) - len(kept)}")
    aborted = _shown(found, "a client-aborted request the engine sampled past (runner records: --level full)")
    return aborted + "; " + _shown(stopped, "a stop-string request with the runner's sampled tokens recorded")
