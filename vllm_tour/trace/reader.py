"""Read a run directory back: merge every process's JSON Lines into one `Step` per engine step.

A process killed mid-write leaves at most one partial line at the end of its
file: that line is skipped with a warning. A run that did not finish (no
outputs.json, meta status "running") still loads — its steps are whatever was
flushed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from vllm_tour.errors import TourError
from vllm_tour.paths import GOLDEN_DIR, RUNS_DIR
from vllm_tour.trace.schema import (
    SCHEMA_VERSION,
    AbortRecord,
    AttentionRecord,
    CaptureRecord,
    CollectiveRecord,
    KVRecord,
    MoERecord,
    Outputs,
    ProbeErrorRecord,
    ProbeTargetRecord,
    Record,
    RunMeta,
    RunnerRecord,
    SchedulerRecord,
    ServerRequestRecord,
    SpecProposalRecord,
    SpecVerifyRecord,
    TPShardsRecord,
)
from vllm_tour.trace.writer import LATEST_NAME

_RECORD = TypeAdapter(Record)


@dataclass
class Step:
    index: int
    scheduler: SchedulerRecord | None = None
    kv: KVRecord | None = None
    runner: dict[int, RunnerRecord] = field(default_factory=dict)  # by TP rank
    attention: dict[int, AttentionRecord] = field(default_factory=dict)  # by TP rank
    captures: list[CaptureRecord] = field(default_factory=list)
    collectives: dict[int, list[CollectiveRecord]] = field(default_factory=dict)  # by TP rank, in call order
    errors: list[ProbeErrorRecord] = field(default_factory=list)
    moe: dict[int, list[MoERecord]] = field(default_factory=dict)  # by TP/EP rank, in layer order
    aborts: list[AbortRecord] = field(default_factory=list)  # requests the engine dropped during this step
    spec_verify: SpecVerifyRecord | None = None  # speculative decoding: the drafts this step verified
    spec_proposal: SpecProposalRecord | None = None  # and the drafts proposed after it, for the next step


@dataclass
class Run:
    path: Path
    meta: RunMeta
    outputs: Outputs | None
    steps: list[Step]
    errors: list[ProbeErrorRecord]
    warnings: list[str]
    tp_shards: dict[int, TPShardsRecord] = field(default_factory=dict)  # by TP rank (TP > 1 runs)
    replaced_targets: list[ProbeTargetRecord] = field(default_factory=list)  # probe targets another plugin replaced
    # `serve` runs: each engine request as the OpenAI server's front end saw it, in the order they ended
    server_requests: list[ServerRequestRecord] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.meta.status == "ok" and self.outputs is not None

    def step(self, index: int) -> Step:
        for s in self.steps:
            if s.index == index:
                return s
        raise TourError(f"{self.path.name} has no step {index} (steps {self.steps[0].index}..{self.steps[-1].index})" if self.steps else f"{self.path.name} has no steps")

    def request_ids(self) -> list[str]:
        return [r.req_id for r in self.meta.requests]

    def step_rows(self) -> list[dict]:
        """The step table, one plain dict per engine step (`pandas.DataFrame(run.step_rows())` works).

        Columns: step; the scheduler's view (waiting/running before and after, token budget, tokens
        scheduled, the scheduled request ids in batch order, prefilling ids, preempted and finished ids);
        the KV pool's (free blocks, usage, blocks allocated, freed, evicted, prefix-hit tokens), None where
        the run has no KV record; ranks that wrote runner records. Values are copies: editing a row
        changes nothing in the run.
        """
        rows = []
        for s in self.steps:
            sc, kv = s.scheduler, s.kv
            rows.append({
                "step": s.index,
                "waiting_before": sc.waiting_before if sc else None,
                "running_before": sc.running_before if sc else None,
                "waiting_after": sc.waiting_after if sc else None,
                "running_after": sc.running_after if sc else None,
                "token_budget": sc.token_budget if sc else None,
                "tokens_scheduled": sc.tokens_scheduled if sc else None,
                "scheduled": [r.req_id for r in sc.scheduled] if sc else [],
                "prefilling": [r.req_id for r in sc.scheduled if r.is_prefill] if sc else [],
                "preempted": [p.req_id for p in sc.preempted] if sc else [],
                "finished": list(sc.finished) if sc else [],
                "free_blocks": kv.free_blocks if kv else None,
                "kv_usage": kv.usage if kv else None,
                "blocks_allocated": sum(len(b) for b in kv.allocated.values()) if kv else None,
                "blocks_freed": len(kv.freed) if kv else None,
                "blocks_evicted": len(kv.evicted) if kv else None,
                "prefix_hit_tokens": sum(h.num_hit_tokens for h in kv.prefix_hits) if kv else None,
                "ranks": sorted(s.runner),
            })
        return rows

    def request_rows(self) -> list[dict]:
        """One dict per (step, scheduled request): what the scheduler gave it and the blocks it held after."""
        rows = []
        for s in self.steps:
            if s.scheduler is None:
                continue
            tables = s.kv.block_tables if s.kv else {}
            for r in s.scheduler.scheduled:
                rows.append({"step": s.index, **r.model_dump(), "block_table": list(tables.get(r.req_id, []))})
        return rows


def find_run(name: str | Path) -> Path:
    """A run directory from a path, a name under traces/runs or traces/golden, or "latest"."""
    p = Path(name)
    if str(name) == "latest":
        return _latest()
    for cand in (p, RUNS_DIR / p, GOLDEN_DIR / p):
        if cand.is_dir():
            return cand
    raise TourError(f"no run directory {name} (looked in ., {RUNS_DIR}, {GOLDEN_DIR})")


def _latest() -> Path:
    """The run the last trace started (traces/runs/latest, written as it starts; --out runs included).
    Without that pointer (runs from before it, or its run deleted): the run whose meta.json says it
    started last -- never the most recently modified folder, which an export into an old run changes."""
    try:
        pointed = Path((RUNS_DIR / LATEST_NAME).read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        pointed = None
    if pointed and (pointed / "meta.json").is_file():
        return pointed
    started = []
    for d in RUNS_DIR.glob("*"):
        try:
            started.append((float(json.loads((d / "meta.json").read_text(encoding="utf-8")).get("started") or 0), str(d), d))
        except (OSError, ValueError, AttributeError):
            continue
    if not started:
        raise TourError(f"no runs in {RUNS_DIR} yet: record one with `vllm-tour trace --request hello`")
    return max(started)[2]


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TourError(f"{path} is missing: not a vllm-tour run directory ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TourError(f"cannot read {path}: {e}") from None


def read_records(path: Path, warnings: list[str]) -> list:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError as e:
        raise TourError(f"cannot read {path}: {e}") from None
    if lines and lines[-1] == "":
        lines.pop()
    records = []
    tables = _Tables()
    for i, line in enumerate(lines, 1):
        try:
            rec = _RECORD.validate_json(line)
        except ValidationError as e:
            if i == len(lines):  # the writer was killed mid-line
                warnings.append(f"{path.name}: skipped a truncated last line ({i})")
                break
            # A garbled line in the middle (a disk or copy error) loses that record, not the run.
            warnings.append(f"{path}:{i}: skipped a line that is not a trace record ({e.errors()[0]['msg']})")
            tables.lost_lines = True
            continue
        try:
            tables.expand(rec)
        except ValueError as e:
            raise TourError(f"{path}:{i}: {e}") from None
        if tables.rebased:
            warnings.append(f"{path}:{i}: {tables.rebased}")
            tables.rebased = ""
        records.append(rec)
    return records


class _Tables:
    """The block tables of one records file so far: expands the probes' deltas into full tables."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[int, dict[str, list[int]]]] = {}  # rank -> (step, tables)
        self.attn: dict[int, tuple[int, list[list[int]]]] = {}  # rank -> (step, rows)
        self.lost_lines = False  # a line of this file was skipped: a later delta may miss its base
        self.rebased = ""  # a warning for read_records: block tables rebuilt on an older base
        self._warned: set = set()

    def expand(self, rec) -> None:
        if isinstance(rec, KVRecord):
            if rec.block_tables_since is not None:
                full = dict(self._base(self.kv, rec, rec.block_tables_since))
                for rid, table in rec.block_tables.items():
                    if table:
                        full[rid] = table
                    else:
                        full.pop(rid, None)
                rec.block_tables, rec.block_tables_since = full, None
            self.kv[rec.proc.rank] = (rec.step, rec.block_tables)
        elif isinstance(rec, AttentionRecord):
            if rec.block_table_since is not None:
                rows = list(self._base(self.attn, rec, rec.block_table_since)[: rec.num_reqs])
                rows += [[] for _ in range(rec.num_reqs - len(rows))]
                for i, row in zip(rec.block_table_rows or [], rec.block_table):
                    rows[i] = row
                rec.block_table, rec.block_table_since, rec.block_table_rows = rows, None, None
            self.attn[rec.proc.rank] = (rec.step, rec.block_table)

    def _base(self, seen: dict, rec, since: int):
        step, value = seen.get(rec.proc.rank, (None, None))
        if step != since and self.lost_lines and step is not None:
            # Its base was the skipped line: rebuild on the last table this file had. A request whose
            # table changed only in the lost step keeps its older table: say so, once per kind and rank.
            if (rec.kind, rec.proc.rank) not in self._warned:
                self._warned.add((rec.kind, rec.proc.rank))
                self.rebased = (f"{rec.kind} block tables of rank {rec.proc.rank} from step {rec.step} on are rebuilt "
                                f"without the skipped line (a delta against step {since}; they may miss that step's changes)")
            return value
        if step != since:
            raise ValueError(f"{rec.kind} record of step {rec.step} is a delta against step {since}, "
                             f"but the previous {rec.kind} record of rank {rec.proc.rank} in this file is "
                             + (f"step {step}" if step is not None else "missing"))
        return value


def _missing_rank_steps(steps: list[Step]) -> list[str]:
    """A rank that recorded the model runner in some steps but not in others where another rank did: its
    process ended (or was killed) before it flushed them. Said once per rank, never taken for agreement."""
    ranks = sorted({r for s in steps for r in s.runner})
    out = []
    for r in ranks[1:] if len(ranks) > 1 else []:
        missing = [s.index for s in steps if s.runner and r not in s.runner]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            out.append(f"rank {r} has no runner record for step(s) {shown} that other ranks recorded (its process "
                       f"ended before it flushed them): those steps show the ranks that did")
    return out


def load_run(path: str | Path) -> Run:
    """Load a run directory (or a name: see find_run). Bad or missing files are TourErrors."""
    path = find_run(path)
    warnings: list[str] = []
    meta_data = _read_json(path / "meta.json", "meta.json")
    try:
        meta = RunMeta.model_validate(meta_data)
    except ValidationError as e:
        raise TourError(f"{path / 'meta.json'}: invalid ({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from None
    if meta.schema_version > SCHEMA_VERSION:
        raise TourError(f"{path} was written with trace schema {meta.schema_version}; this vllm-tour reads up to {SCHEMA_VERSION}")
    outputs = None
    if (path / "outputs.json").exists():
        try:
            outputs = Outputs.model_validate(_read_json(path / "outputs.json", "outputs.json"))
        except ValidationError as e:
            raise TourError(f"{path / 'outputs.json'}: invalid ({e.errors()[0]['msg']})") from None
    elif meta.status == "running":
        warnings.append("the run did not finish (killed or still running): showing the steps it flushed")
    elif meta.status == "failed":
        warnings.append(f"the run failed: {meta.error}")
    elif meta.status == "interrupted":
        warnings.append("the run was interrupted (Ctrl-C): showing the steps it flushed")

    steps: dict[int, Step] = {}
    errors: list[ProbeErrorRecord] = []
    tp_shards: dict[int, TPShardsRecord] = {}
    replaced: list[ProbeTargetRecord] = []
    served: list[ServerRequestRecord] = []
    for f in sorted(path.glob("records.*.jsonl")):
        for rec in read_records(f, warnings):
            if isinstance(rec, ServerRequestRecord):  # the front end counts no steps
                served.append(rec)
                continue
            s = steps.setdefault(rec.step, Step(rec.step))
            if isinstance(rec, SchedulerRecord):
                s.scheduler = rec
            elif isinstance(rec, KVRecord):
                s.kv = rec
            elif isinstance(rec, RunnerRecord):
                s.runner[rec.proc.rank] = rec
            elif isinstance(rec, AttentionRecord):
                s.attention[rec.proc.rank] = rec
            elif isinstance(rec, CaptureRecord):
                s.captures.append(rec)
            elif isinstance(rec, CollectiveRecord):
                s.collectives.setdefault(rec.proc.rank, []).append(rec)
            elif isinstance(rec, TPShardsRecord):
                tp_shards[rec.proc.rank] = rec
            elif isinstance(rec, ProbeErrorRecord):
                s.errors.append(rec)
                errors.append(rec)
            elif isinstance(rec, AbortRecord):
                s.aborts.append(rec)
            elif isinstance(rec, SpecVerifyRecord):
                s.spec_verify = rec
            elif isinstance(rec, SpecProposalRecord):
                s.spec_proposal = rec
            elif isinstance(rec, MoERecord):
                s.moe.setdefault(rec.proc.rank, []).append(rec)
            elif isinstance(rec, ProbeTargetRecord):
                replaced.append(rec)
                warnings.append(f"probe {rec.probe}: its target {rec.target} is {rec.replaced_by} (another plugin "
                                f"replaced it {rec.when.replace('_', ' ')}): the probe records that function")
    if meta.engine_args.get("probes", True) and not steps and meta.status == "ok":
        warnings.append("no trace records: the probes did not record (was the vllm-tour plugin installed?)")
    ordered = [steps[k] for k in sorted(steps)]
    # Step 0 only holds probe errors raised before the first schedule(): keep them, but not as a step.
    ordered = [s for s in ordered if s.index > 0 or s.scheduler or s.runner or s.aborts]
    served.sort(key=lambda r: r.finished_time)
    warnings += _missing_rank_steps(ordered)
    return Run(path=path, meta=meta, outputs=outputs, steps=ordered, errors=errors, warnings=warnings, tp_shards=tp_shards,
               replaced_targets=replaced, server_requests=served)
