"""Read a run directory back: merge every process's JSON Lines into one `Step` per engine step.

A process killed mid-write leaves at most one partial line at the end of its
file: that line is skipped with a warning. A run that did not finish (no
outputs.json, meta status "running") still loads — its steps are whatever was
flushed.

A window of steps (`load_run(path, steps=(a, b))`, or a time range) reads only the segments that
index.jsonl says overlap it (see trace/writer.py), and of their lines validates only the window's: the
lines before it are read just far enough to carry the block tables forward.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
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
from vllm_tour.trace.writer import INDEX_NAME, LATEST_NAME

_RECORD = TypeAdapter(Record)
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*-\s*(\d+(?:\.\d*)?)\s*$")  # "A-B"


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


UNFINISHED = "the run did not finish (killed or still running): showing the steps it flushed"


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
    window: tuple[int, int] | None = None  # (first, last) step asked for: `steps` holds only those
    # A window's next step (None: the run has none): its scheduler record's `finished` says which
    # requests the window's last step finished.
    next_step: Step | None = None

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


class _ProcRank(msgspec.Struct):
    rank: int = 0


class _KVTables(msgspec.Struct):
    """The fields of a KV record that carry its block tables (decoded without the rest, or any validation)."""

    step: int
    kind: str
    proc: _ProcRank
    block_tables: dict[str, list[int]]
    block_tables_since: int | None = None


class _AttentionRows(msgspec.Struct):
    step: int
    kind: str
    proc: _ProcRank
    num_reqs: int
    block_table: list[list[int]]
    block_table_since: int | None = None
    block_table_rows: list[int] | None = None


_KV_TABLES = msgspec.json.Decoder(_KVTables)
_ATTENTION_ROWS = msgspec.json.Decoder(_AttentionRows)


class _Head(msgspec.Struct):
    """What a time window needs of a record: its step, kind and (scheduler records) time."""

    step: int
    kind: str
    time: float | None = None


_HEAD = msgspec.json.Decoder(_Head)
_STEP_PREFIX = b'{"step":'  # every writer puts `step` first (schema._Record's first field)


def _line_step(line: bytes) -> int | None:
    """A line's step, read off its first bytes (None: not in the writers' form; validate the line)."""
    if line.startswith(_STEP_PREFIX):
        end = line.find(b",", len(_STEP_PREFIX))
        digits = line[len(_STEP_PREFIX) : end]
        if digits.isdigit():
            return int(digits)
    return None


def read_records(path: Path, warnings: list[str], steps: tuple[int, int] | None = None) -> list:
    """The records of one file, block tables expanded; `steps` (a, b): only those of steps a..b."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise TourError(f"cannot read {path}: {e}") from None
    if lines and lines[-1] == b"":
        lines.pop()
    records = []
    tables = _Tables()
    for i, line in enumerate(lines, 1):
        step = _line_step(line) if steps is not None else None
        if step is not None and not steps[0] <= step <= steps[1]:
            # Outside the window: only a block-table record before it is read, as the base of later deltas.
            decoder = None
            if step < steps[0]:
                decoder = _KV_TABLES if b'"kind":"kv"' in line else _ATTENTION_ROWS if b'"kind":"attention"' in line else None
            if decoder is not None:
                try:
                    tables.expand(decoder.decode(line))
                except (msgspec.ValidationError, msgspec.DecodeError):
                    tables.lost_lines = True  # the full read warns about it when the window holds it
                except ValueError as e:
                    raise TourError(f"{path}:{i}: {e}") from None
            continue
        line = line.decode("utf-8", errors="replace")
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
        """Fill in a record's block tables from its delta (a schema record, or a _KVTables / _AttentionRows)."""
        if rec.kind == "kv":
            if rec.block_tables_since is not None:
                full = dict(self._base(self.kv, rec, rec.block_tables_since))
                for rid, table in rec.block_tables.items():
                    if table:
                        full[rid] = table
                    else:
                        full.pop(rid, None)
                rec.block_tables, rec.block_tables_since = full, None
            self.kv[rec.proc.rank] = (rec.step, rec.block_tables)
        elif rec.kind == "attention":
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


def parse_window(text: str, option: str, whole: bool) -> tuple:
    """"A-B" -> (A, B) with 0 <= A <= B, ints when `whole`; anything else is a TourError naming `option`."""
    m = _WINDOW.match(text)
    if not m or (whole and not (m[1].isdigit() and m[2].isdigit())):
        raise TourError(f"{option} {text!r}: give a range FIRST-LAST of {'step numbers' if whole else 'seconds'}, "
                        f"e.g. {'1000-1100' if whole else '60-90.5'}")
    a, b = (int(m[1]), int(m[2])) if whole else (float(m[1]), float(m[2]))
    if b < a:
        raise TourError(f"{option} {text}: the range ends before it starts")
    return a, b


def read_index(path: Path) -> dict[str, dict]:
    """index.jsonl: segment file name -> its latest entry (an open segment's last_step is None).
    A line that is not an entry (a writer killed mid-line) is skipped: its segment is then read in full."""
    entries = {}
    try:
        lines = (path / INDEX_NAME).read_bytes().splitlines()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise TourError(f"cannot read {path / INDEX_NAME}: {e}") from None
    for line in lines:
        try:
            entry = json.loads(line)
            entries[entry["file"]] = entry
        except (ValueError, KeyError, TypeError):
            continue
    return entries


def _overlaps(entry: dict | None, first: str, last: str, lo: float, hi: float) -> bool:
    """Whether a segment's [first, last] range meets [lo, hi]; no entry, or no last yet: read it."""
    if entry is None or entry.get(first) is None:
        return True
    return entry[first] <= hi and (entry.get(last) is None or entry[last] >= lo)


def _records_files(path: Path, index: dict[str, dict], key: tuple[str, str] | None = None,
                   window: tuple[float, float] | None = None) -> list[Path]:
    files = sorted(path.glob("records.*.jsonl"))
    if window is None:
        return files
    return [f for f in files if _overlaps(index.get(f.name), *key, *window)]


def steps_between(path: str | Path, seconds: tuple[float, float]) -> tuple[int, int]:
    """The first and last step scheduled between `seconds` (t0, t1) after the run started (its meta.json)."""
    path = find_run(path)
    return _steps_between(path, _meta(path), read_index(path), seconds)


def _steps_between(path: Path, meta: RunMeta, index: dict[str, dict], seconds: tuple[float, float]) -> tuple[int, int]:
    """The first and last step whose scheduler record's time lies `seconds` (since the run started) in."""
    if not meta.started:
        raise TourError(f"{path.name} keeps no wall times (a golden run's are zeroed): give a window of steps instead")
    lo, hi = meta.started + seconds[0], meta.started + seconds[1]
    found = []
    for f in _records_files(path, index, ("first_time", "last_time"), (lo, hi)):
        try:
            lines = f.read_bytes().split(b"\n")
        except OSError as e:
            raise TourError(f"cannot read {f}: {e}") from None
        for line in lines:
            if b'"kind":"scheduler"' not in line:
                continue
            try:
                head = _HEAD.decode(line)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue  # a truncated last line: the full read warns about it
            if head.kind == "scheduler" and lo <= head.time <= hi:
                found.append(head.step)
    if not found:
        raise TourError(f"no step of {path.name} was scheduled {seconds[0]:g}-{seconds[1]:g} s after the run "
                        f"started ({_extent(path, index)})")
    return min(found), max(found)


def last_step(path: Path, index: dict[str, dict]) -> int | None:
    """The last step recorded, from the index and the ends of the segments still being written
    (None: no index, or no step yet)."""
    last = [e["last_step"] for e in index.values() if e.get("last_step") is not None]
    for name, entry in index.items():
        if entry.get("last_step") is None:
            last += _steps_at_end(path / name)
    return max(last, default=None)


TAIL_BYTES = 1 << 16  # the end of a segment read to find its last step: many records' worth


def _steps_at_end(path: Path) -> list[int]:
    try:
        with open(path, "rb") as f:
            start = f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().split(b"\n")
    except OSError:
        return []
    lines = lines[1 if start else 0 : -1]  # whole lines only: the first may be cut, the last still being written
    return [s for s in map(_line_step, lines) if s is not None]


def load_tail(path: str | Path, steps: int) -> Run:
    """The last `steps` steps of a run, read from the segments that hold them (a run without index.jsonl,
    or without steps yet, is read whole)."""
    path = find_run(path)
    last = last_step(path, read_index(path))
    if last is None or last < 1:
        return load_run(path)
    return load_run(path, steps=(max(1, last - steps + 1), last))


def _extent(path: Path, index: dict[str, dict]) -> str:
    """The run's steps, as the index knows them (else as a full read finds them)."""
    if index:
        first = min(e["first_step"] for e in index.values())
        lasts = [e["last_step"] for e in index.values()]
        last = max(x for x in lasts if x is not None) if any(x is not None for x in lasts) else first
        return f"it has steps {first}..{last}{' and more being written' if None in lasts else ''}"
    steps = load_run(path).steps
    return f"it has steps {steps[0].index}..{steps[-1].index}" if steps else "it has no steps"


def _meta(path: Path) -> RunMeta:
    meta_data = _read_json(path / "meta.json", "meta.json")
    try:
        meta = RunMeta.model_validate(meta_data)
    except ValidationError as e:
        raise TourError(f"{path / 'meta.json'}: invalid ({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from None
    if meta.schema_version > SCHEMA_VERSION:
        raise TourError(f"{path} was written with trace schema {meta.schema_version}; this vllm-tour reads up to {SCHEMA_VERSION}")
    return meta


def load_run(path: str | Path, steps: tuple[int, int] | None = None, seconds: tuple[float, float] | None = None) -> Run:
    """Load a run directory (or a name: see find_run). Bad or missing files are TourErrors.

    `steps` (a, b): only steps a..b (and Run.next_step, step b + 1); `seconds` (t0, t1): only the steps
    scheduled between t0 and t1 seconds after the run started. Either reads only the records files whose
    index entry overlaps the window; a window with no step in the run is a TourError."""
    path = find_run(path)
    warnings: list[str] = []
    meta = _meta(path)
    outputs = None
    if (path / "outputs.json").exists():
        try:
            outputs = Outputs.model_validate(_read_json(path / "outputs.json", "outputs.json"))
        except ValidationError as e:
            raise TourError(f"{path / 'outputs.json'}: invalid ({e.errors()[0]['msg']})") from None
    elif meta.status == "running":
        warnings.append(UNFINISHED)
    elif meta.status == "failed":
        warnings.append(f"the run failed: {meta.error}")
    elif meta.status == "interrupted":
        warnings.append("the run was interrupted (Ctrl-C): showing the steps it flushed")

    index = read_index(path) if steps is not None or seconds is not None else {}
    if seconds is not None:
        steps = _steps_between(path, meta, index, seconds)
    by_step: dict[int, Step] = {}
    errors: list[ProbeErrorRecord] = []
    tp_shards: dict[int, TPShardsRecord] = {}
    replaced: list[ProbeTargetRecord] = []
    served: list[ServerRequestRecord] = []
    wanted = (steps[0], steps[1] + 1) if steps is not None else None  # the window and its next step
    for f in _records_files(path, index, ("first_step", "last_step"), wanted):
        for rec in read_records(f, warnings, wanted):
            if isinstance(rec, ServerRequestRecord):  # the front end counts no steps
                served.append(rec)
                continue
            s = by_step.setdefault(rec.step, Step(rec.step))
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
    if meta.engine_args.get("probes", True) and not by_step and meta.status == "ok" and steps is None:
        warnings.append("no trace records: the probes did not record (was the vllm-tour plugin installed?)")
    ordered = [by_step[k] for k in sorted(by_step)]
    # Step 0 only holds probe errors raised before the first schedule(): keep them, but not as a step.
    ordered = [s for s in ordered if s.index > 0 or s.scheduler or s.runner or s.aborts]
    next_step = None
    if steps is not None:
        if ordered and ordered[-1].index == steps[1] + 1:
            next_step = ordered.pop()
        if not ordered:
            raise TourError(f"steps {steps[0]}-{steps[1]} are not in {path.name} ({_extent(path, index)})")
        errors = [e for e in errors if e.step <= steps[1]]
    served.sort(key=lambda r: r.finished_time)
    warnings += _missing_rank_steps(ordered)
    return Run(path=path, meta=meta, outputs=outputs, steps=ordered, errors=errors, warnings=warnings, tp_shards=tp_shards,
               replaced_targets=replaced, server_requests=served, window=steps, next_step=next_step)
