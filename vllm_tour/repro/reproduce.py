"""`vllm-tour repro`: run a scenario that encodes an upstream issue and check its `[expect]` section.

The scenario runs on the installed upstream engine with probes on (a normal
run directory under traces/runs/), or with `mode = "scheduler"` on upstream's
Scheduler alone (sched_harness.py). An engine failure is a result, not an
error: the trace flushed up to the failure is kept and read back, and the
failure text (exception chain, vLLM ERROR log lines) is what
`engine_fails_with` is checked against.

Expectations are per pin: `[expect]` holds on every pin, `[expect."v0.21.0"]`
adds to it (or replaces a key) on that pin only, and `verdicts` declares what
each pin is held to (a fix that landed between the pins: NOT REPRODUCED on the
newer one). Only the installed pin runs here; the others are reported as not
run. Exit 0 REPRODUCED, 1 NOT REPRODUCED, 2 could not run (TourError: bad
file, unknown model, no expectations for the installed pin...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vllm_tour.engine.upstream_log import summary_line
from vllm_tour.errors import TourError
from vllm_tour.repro.expect_sched import Check, scheduling_checks
from vllm_tour.scenario import ExpectSpec, Scenario, load_scenario
from vllm_tour.trace import levels
from vllm_tour.trace.reader import Run, load_run


@dataclass
class ReproResult:
    scenario: Scenario
    pin: str  # the pin it ran on (the installed vLLM)
    run_dir: Path
    run: Run
    failure: str | None  # the engine's error, None when it finished
    log_errors: list[str]
    checks: list[Check]
    alone: dict[str, list[int]] = field(default_factory=dict)  # same_tokens_alone: each request's tokens run alone

    @property
    def reproduced(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def verdict(self) -> str:
        return "REPRODUCED" if self.reproduced else "NOT REPRODUCED"

    @property
    def as_declared(self) -> bool:
        return self.verdict == self.scenario.declared_verdict(self.pin)


GPU_PIN_NOTE = "the GPU machine's pin, run there"


def where_it_runs(pin: str) -> str:
    """Where a pin this command did not run is run: the GPU machine's (a CUDA pin), or its own environment here."""
    from vllm_tour.upstream.pins import available_pins, load_pin

    if pin in available_pins() and load_pin(pin).platform == "cpu":
        return f"another CPU release: `repro FILE --pin {pin}` runs it, `repro --matrix` runs every release here"
    return GPU_PIN_NOTE


def not_run_here(sc: Scenario, pin: str) -> list[str]:
    """The pins this repro has expectations for that do not run on this machine (installed: `pin`)."""
    return [p for p in sc.pins() if p != pin]


class _ErrorLines(logging.Filter):
    """vLLM's ERROR log lines of this process (e.g. "Worker proc ... died unexpectedly (exit code: -11)").

    A logger filter, not a handler: the engine re-runs vLLM's dictConfig, which
    clears the handlers of "vllm" and its child loggers but keeps their filters.
    It lets every record through."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record):
        if record.levelno >= logging.ERROR:
            try:
                line = record.getMessage().splitlines()[0][:300]
            except Exception:
                line = ""
            if line:
                self.lines.append(line)
        return True


# The loggers that report a dying engine (dump_input's long config dumps are left out).
_ERROR_LOGGERS = ("vllm.v1.executor.multiproc_executor", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine")


def _chain(e: BaseException | None) -> list[str]:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return out


def _engine_failed(run_dir: Path) -> bool:
    """The run got as far as starting the engine, and its meta.json says it failed."""
    import json

    try:
        return json.loads((run_dir / "meta.json").read_text(encoding="utf-8")).get("status") == "failed"
    except (OSError, ValueError):
        return False


def installed_pin() -> str:
    from vllm_tour.upstream.pins import active_pin_tag

    return active_pin_tag()


def expectations_here(sc: Scenario, path: Path | str, pin: str) -> ExpectSpec:
    """The expectations checked on `pin`; TourError when the file has none for it."""
    ex = sc.expect_for(pin)
    if ex is None or not ex.keys():
        if sc.pins():
            raise TourError(f"scenario {path} has expectations for {', '.join(sc.pins())} only; this machine runs "
                            f"{pin} (see `vllm-tour repro --all` for the other pins' status)")
        raise TourError(f"scenario {path} has no [expect] section: nothing to reproduce "
                        f"(keys: {', '.join(ExpectSpec.model_fields)})")
    return ex


# Expectations that read more than the scheduler records: the trace level they need (trace/levels.py)
NEEDS_LEVEL = {"prefix_hit_tokens": "blocks", "blocked_behind": "blocks", "expert_maps": "full",
               "moe_kernel_ids_out_of_range": "full"}


def needed_level(ex: ExpectSpec) -> str:
    """The lowest level whose records the expectations can be judged on; blocks at least, so that `show` of
    a repro run has its block grid to look at."""
    given = ex.model_dump(exclude_defaults=True)
    return max(["blocks", *(NEEDS_LEVEL[k] for k in given if k in NEEDS_LEVEL)], key=levels.rank)


def run_repro(path: Path | str, run_dir: Path | None = None, force: bool = False, progress=None,
              level: str | None = None, pin: str | None = None) -> ReproResult:
    from vllm_tour.engine.run import new_run_dir, run_upstream
    from vllm_tour.engine.sched_harness import run_scheduler
    from vllm_tour.engine.trace_command import check_out
    from vllm_tour.paths import RUNS_DIR
    from vllm_tour.trace.writer import mark_latest

    check_out(run_dir, force)  # and an old meta.json there would read as this run's failure
    sc = load_scenario(path)
    pin = pin or sc.pin or installed_pin()
    sc = sc.model_copy(update={"pin": pin})  # the engine checks it against the installed vLLM before it starts
    ex = expectations_here(sc, path, pin)
    need = needed_level(ex)
    level = levels.check_level(level) if level else need
    if not levels.has(level, need):
        raise TourError(f"--level {level}: {sc.name}'s expectations are judged on records of level {need} "
                        f"({', '.join(k for k in ex.model_dump(exclude_defaults=True) if k in NEEDS_LEVEL) or 'show'}); "
                        f"give --level {need} or leave it out")
    fresh = not run_dir  # a new dir under traces/runs, created (atomically) here
    run_dir = Path(run_dir) if run_dir else new_run_dir(sc.name)
    handler = _ErrorLines()
    loggers = [logging.getLogger(n) for n in _ERROR_LOGGERS]
    for lg in loggers:
        lg.addFilter(handler)
    failure = None
    try:
        if sc.mode == "scheduler":
            mark_latest(RUNS_DIR, run_dir)
            run_scheduler(sc, run_dir, progress)
        else:
            run_upstream(sc, run_dir, probes=True, progress=progress, level=level, latest=True)
    except TourError as e:
        if not _engine_failed(run_dir):
            if fresh and run_dir.is_dir() and not any(run_dir.iterdir()):
                run_dir.rmdir()  # nothing half-written: the dir this command created stays empty
            raise  # it never started (pin, model, probes): could not run
        failure = "\n".join(_chain(e.__cause__) or [str(e)])
    finally:
        for lg in loggers:
            lg.removeFilter(handler)
    run = load_run(run_dir)
    if failure is None and run.meta.status == "failed":
        failure = run.meta.error or "failed"
    alone = run_alone(sc, run_dir, list(ex.same_tokens_alone), progress) if ex.same_tokens_alone and failure is None else {}
    checks = check_expectations(sc, run, failure, handler.lines, ex, alone)
    return ReproResult(sc, pin, run_dir, run, failure, handler.lines, checks, alone)


def run_alone(sc: Scenario, run_dir: Path, req_ids: list[str], progress=None) -> dict[str, list[int]]:
    """Each request's tokens when it is the only request in the engine (run_dir/alone-<id>/, one engine run each)."""
    from vllm_tour.engine.run import run_upstream

    out = {}
    for rid in req_ids:
        spec = next(r for r in sc.requests if r.req_id == rid).model_copy(update={"arrival_step": 0})
        solo = sc.model_copy(update={"name": f"{sc.name}-alone-{rid}", "requests": [spec], "expect": None,
                                     "expect_by_pin": {}, "verdicts": {}})
        run = load_run(run_upstream(solo, run_dir / f"alone-{rid}", probes=True, progress=progress))
        out[rid] = next(o.token_ids for o in run.outputs.requests if o.req_id == rid)
    return out


# --- the expectations ------------------------------------------------------------


def _fmt(key: str, value) -> str:
    import json

    return f"{key} = {json.dumps(value)}"


def _failed_note(failure: str | None) -> list[str]:
    return [f"the engine failed first: {failure.splitlines()[0]}"] if failure else []


def _last_step_line(run: Run) -> str:
    if not run.steps:
        return "no step was traced (the engine failed before its first schedule)"
    s = run.steps[-1]
    sched = ", ".join(f"{r.req_id}:{r.kind} {r.num_scheduled_tokens} tok" for r in s.scheduler.scheduled) if s.scheduler else "-"
    ranks = sorted(s.runner)
    runner = f"runner records from TP ranks {ranks}" if ranks else "no runner record (no worker returned from the forward pass)"
    return f"last traced step {s.index}: scheduled [{sched}]; {runner}"


def check_expectations(sc: Scenario, run: Run, failure: str | None, log_errors: list[str],
                       ex: ExpectSpec | None = None, alone: dict[str, list[int]] | None = None) -> list[Check]:
    """alone: each request's tokens when it ran alone (run_alone), for same_tokens_alone."""
    ex = ex or sc.expect
    checks: list[Check] = []
    if ex.engine_fails_with is not None:
        text = "\n".join([failure or "", *log_errors])
        if failure is None:
            checks.append(Check(_fmt("engine_fails_with", ex.engine_fails_with), False,
                                [f"the engine finished: {len(run.outputs.requests) if run.outputs else 0} requests in {len(run.steps)} steps, no error"]))
        else:
            ev = [f"engine error: {line}" for line in failure.splitlines()[:3]]
            ev += [f"vLLM log: {line}" for line in log_errors[:4]]
            ev.append(_last_step_line(run))
            checks.append(Check(_fmt("engine_fails_with", ex.engine_fails_with), ex.engine_fails_with in text, ev))

    def per_request(key: str, ids: list[str], find) -> None:
        for rid in ids:
            hits = find(rid)
            ev = hits[:3] + ([f"... and {len(hits) - 3} more"] if len(hits) > 3 else [])
            if not hits:
                ev = [f"{rid}: never {key} in {len(run.steps)} traced steps"] + _failed_note(failure)
            checks.append(Check(_fmt(key, [rid]) if len(ids) == 1 else f"{key}: {rid}", bool(hits), ev))

    def preempted(rid):
        return [f"step {s.index}: {rid} preempted ({p.reason}; while allocating for {p.while_allocating_for}, "
                f"freed blocks {p.freed_block_ids}, lost {p.num_computed_tokens_lost} computed tokens)"
                for s in run.steps if s.scheduler for p in s.scheduler.preempted if p.req_id == rid]

    def resumed(rid):
        return [f"step {s.index}: {rid} resumed: {r.num_scheduled_tokens} tokens scheduled (recompute), {r.num_computed_tokens} already computed"
                for s in run.steps if s.scheduler for r in s.scheduler.scheduled if r.req_id == rid and r.kind == "resumed"]

    per_request("preempted", ex.preempted, preempted)
    per_request("resumed", ex.resumed, resumed)

    for rid, want in ex.prefix_hit_tokens.items():
        hits = [(s.index, h) for s in run.steps if s.kv for h in s.kv.prefix_hits if h.req_id == rid]
        best = max((h.num_hit_tokens for _, h in hits), default=0)
        ev = [f"step {i}: {rid} hit {h.num_hit_tokens} cached tokens (blocks {h.block_ids})" for i, h in hits if h.num_hit_tokens][:3]
        if not ev:
            ev = [f"{rid}: no prefix-cache hit in {len(run.steps)} traced steps"] + _failed_note(failure)
        elif best < want:
            ev.append(f"{rid}: at most {best} tokens, expected at least {want}")
        checks.append(Check(f"prefix_hit_tokens.{rid} >= {want}", best >= want, ev))

    if ex.tokens_equal:
        key = _fmt("tokens_equal", ex.tokens_equal)
        got = {o.req_id: o.token_ids for o in run.outputs.requests} if run.outputs else {}
        missing = [r for r in ex.tokens_equal if r not in got]
        if missing:
            checks.append(Check(key, False, [f"no output for {', '.join(missing)}"] + _failed_note(failure)))
        else:
            first, *rest = ex.tokens_equal
            ev, ok = [], True
            for rid in rest:
                a, b = got[first], got[rid]
                if a == b:
                    ev.append(f"{first} == {rid}: {len(a)} tokens {a[:8]}{' ...' if len(a) > 8 else ''}")
                    continue
                ok = False
                pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                ev.append(f"{first} != {rid} at position {pos}: {a[pos:pos + 1]} vs {b[pos:pos + 1]} (lengths {len(a)}, {len(b)})")
            checks.append(Check(key, ok, ev))

    got = {o.req_id: o.token_ids for o in run.outputs.requests} if run.outputs else {}
    for rid, want_same in ex.same_tokens_alone.items():
        key = _fmt(f"same_tokens_alone.{rid}", want_same)
        if rid not in got or rid not in (alone or {}):
            checks.append(Check(key, False, [f"no output for {rid} {'alone' if rid in got else 'in the batch'}"] + _failed_note(failure)))
            continue
        a, b = got[rid], alone[rid]
        if a == b:
            ev = f"{rid} in the batch and alone: the same {len(a)} tokens {a[:8]}{' ...' if len(a) > 8 else ''}"
        else:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            ev = f"{rid} differs at output position {pos}: {a[pos:pos + 1]} in the batch vs {b[pos:pos + 1]} alone"
        checks.append(Check(key, (a == b) == want_same, [ev]))
    for rid in ex.drafts_not_in_sequence:
        checks.append(_drafts_not_in_sequence_check(rid, run, failure))
    checks.extend(scheduling_checks(ex, run, failure))
    if ex.expert_maps:
        checks.extend(_expert_map_checks(ex.expert_maps, run, failure))
    if ex.moe_kernel_ids_out_of_range is not None:
        checks.append(_kernel_ids_check(ex.moe_kernel_ids_out_of_range, run, failure))
    return checks


def _drafts_not_in_sequence_check(rid: str, run: Run, failure: str | None) -> Check:
    """Drafts verified for `rid` holding a token that its prompt and its whole output never hold: an n-gram
    proposer copies tokens of the sequence, so such a draft came from somewhere else (a runner's dummy drafts)."""
    key = _fmt("drafts_not_in_sequence", [rid])
    meta = next(r for r in run.meta.requests if r.req_id == rid)
    out = next((o.token_ids for o in run.outputs.requests if o.req_id == rid), []) if run.outputs else []
    seq = set(meta.prompt_token_ids or []) | set(out)
    verified = [(s.index, v) for s in run.steps if s.spec_verify for v in s.spec_verify.requests if v.req_id == rid]
    hits = [f"step {i}: {rid} verified drafts {v.draft_token_ids} at position {v.num_computed_tokens + 1}; "
            f"{sorted(set(v.draft_token_ids) - seq)} never in its {len(meta.prompt_token_ids or [])} prompt and "
            f"{len(out)} output tokens" for i, v in verified if set(v.draft_token_ids) - seq]
    if hits:
        return Check(key, True, hits[:3] + ([f"... and {len(hits) - 3} more steps"] if len(hits) > 3 else []))
    ev = [f"{rid}: {len(verified)} steps verified drafts, each made of tokens of its own sequence" if verified
          else f"{rid}: no drafts verified in {len(run.steps)} traced steps"]
    return Check(key, False, ev + _failed_note(failure))


def _moe_records(run: Run) -> list:
    """Every MoE record by step, in the order the layers ran on each rank."""
    return [r for s in run.steps for rank in sorted(s.moe) for r in s.moe[rank]]


def _expert_map_checks(want: dict[int, list[int]], run: Run, failure: str | None) -> list[Check]:
    seen: dict[int, tuple[list[int] | None, int, int]] = {}  # rank -> (map, step, layer) of its first MoE record
    for r in _moe_records(run):
        seen.setdefault(r.proc.rank, (r.expert_map, r.step, r.layer))
    checks = []
    for rank, emap in sorted(want.items()):
        key = f"expert_maps.{rank} = {emap}"
        if rank not in seen:
            checks.append(Check(key, False, [f"rank {rank}: no MoE record (its experts kernel never ran)"] + _failed_note(failure)))
            continue
        got, step, layer = seen[rank]
        checks.append(Check(key, got == emap, [f"rank {rank}, step {step}, layer {layer}: the experts kernel got expert map {got}"]))
    return checks


def _kernel_ids_check(want: bool, run: Run, failure: str | None) -> Check:
    key = _fmt("moe_kernel_ids_out_of_range", want)
    records = _moe_records(run)
    if not records:
        return Check(key, False, ["no MoE record: no experts kernel ran (is the model MoE?)"] + _failed_note(failure))
    last = {}  # rank -> its last record: where a rank that died stopped
    bad = []
    for r in records:
        last[r.proc.rank] = r
        out = sorted({e for row in r.topk_ids for e in row if not 0 <= e < r.num_local_experts})
        if out:
            bad.append((r, out))
    ev = []
    for r, out in bad[:4]:
        ev.append(f"step {r.step}, layer {r.layer}, rank {r.proc.rank}: {r.kernel} holds {r.num_local_experts} local "
                  f"experts (expert map {r.expert_map}) and was handed top-k ids {r.topk_ids[:4]}"
                  f"{' ...' if len(r.topk_ids) > 4 else ''}: ids {out} index past its weight tables")
    if failure:
        for rank, r in sorted(last.items()):
            ev.append(f"rank {rank}: last MoE record step {r.step}, layer {r.layer} (written before that kernel ran)")
    if not bad:
        ev.append(f"{len(records)} MoE records: every top-k id the experts kernels got is below their local expert count")
    return Check(key, bool(bad) == want, ev)


# --- the verdict -------------------------------------------------------------------


def render(res: ReproResult, console: Console, path: Path | str) -> None:
    sc = res.scenario
    console.print(f"[bold]repro[/] {escape(sc.name)}  [dim]{escape(str(path))}[/]")
    if sc.description:
        console.print(f"  [dim]{escape(sc.description)}[/]")
    refs = ", ".join(x for x in (f"issue #{sc.issue}" if sc.issue else "", f"PR #{sc.pr}" if sc.pr else "") if x)
    if refs:
        console.print(f"  upstream {refs}")
    e = sc.engine
    console.print(f"  model {sc.model}, TP={e.tensor_parallel_size}"
                  + (", enable_expert_parallel" if e.enable_expert_parallel else "")
                  + (f", num_blocks={e.num_blocks}" if e.num_blocks else "")
                  + "".join(f", {k}={v}" for k, v in e.extra.items())
                  + f"; {len(sc.requests)} request(s)"
                  + ("; scheduler only (sched_harness: no model)" if sc.mode == "scheduler" else ""))
    outcome = f"engine FAILED: {res.failure.splitlines()[0]}" if res.failure else "engine finished"
    console.print(f"  run {escape(str(res.run_dir))} — {len(res.run.steps)} traced steps on {res.pin}, {escape(outcome)}")
    logged = summary_line(res.run_dir, failed=res.failure is not None)
    if logged:
        console.print(f"  [dim]{escape(logged)}[/]", soft_wrap=True)
    for c in res.checks:
        mark = "[green]✓ met    [/]" if c.ok else "[red]✗ NOT MET[/]"
        console.print(f"  {mark} {escape(c.key)}")
        for line in c.evidence:
            console.print(f"             {escape(line)}", soft_wrap=True)
    for other in not_run_here(sc, res.pin):
        console.print(f"  [dim]{other}: not run here ({escape(where_it_runs(other))}); declared {sc.declared_verdict(other)}[/]")
    met = sum(c.ok for c in res.checks)
    declared = sc.declared_verdict(res.pin)
    note = "as declared" if res.as_declared else f"[bold red]declared {declared}[/]"
    if res.reproduced:
        console.print(f"[bold green]REPRODUCED on {res.pin}[/] — {met}/{len(res.checks)} expectations met ({note})")
    else:
        failed = ", ".join(c.key for c in res.checks if not c.ok)
        console.print(f"[bold red]NOT REPRODUCED on {res.pin}[/] — {met}/{len(res.checks)} expectations met; "
                      f"not met: {escape(failed)} ({note})")
