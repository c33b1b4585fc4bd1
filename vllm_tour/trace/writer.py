"""The per-process trace writer: JSON Lines files per process, in segments, flushed per record.

Every vLLM process of a traced run (front end, EngineCore, each worker) gets one
`Recorder`. It is switched on by `activate()` — from the environment in child
processes (the plugin), directly by `run_upstream` in-process — and holds the
step counters and the small per-step scratch state the probes share.

A process's records go to `records.<pid>.<segment>.jsonl` (segment 000000, 000001, ...). A segment
closes at the first step boundary after it holds SEGMENT_STEPS_ENV steps or SEGMENT_BYTES_ENV bytes;
the next one starts with full block tables (no delta reaches back into an older file), so each
segment reads alone. `index.jsonl` (one per run) gets a line when a segment opens and when it closes:
its file, first and last step, first and last wall time; a reader finds the segments of a window
there without reading records.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import msgspec

from vllm_tour.errors import TourError
from vllm_tour.trace import levels
from vllm_tour.trace.schema import ProbeErrorRecord, ProbeTargetRecord, Proc

RUN_DIR_ENV = "VLLM_TOUR_RUN_DIR"
CAPTURE_ENV = "VLLM_TOUR_CAPTURE"  # comma-separated capture names
CAPTURE_STEPS_ENV = "VLLM_TOUR_CAPTURE_STEPS"  # "1-3,7"; empty: every step
FAULT_ENV = "VLLM_TOUR_FAULT"  # a probe name: that probe raises (tests)

# Upstream's input processor makes request ids unique by appending
# "-<8 hex chars>"; traces use the ids the user gave.
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


# This process's id, read once (getpid() is a system call, four records a step ask for it) and again in a
# forked child.
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))

SEGMENT_STEPS_ENV = "VLLM_TOUR_SEGMENT_STEPS"  # steps per records segment
SEGMENT_BYTES_ENV = "VLLM_TOUR_SEGMENT_BYTES"  # bytes per records segment
SEGMENT_STEPS = 10_000  # ~13 MB at ~16 running requests (bench.long_run): a window reads one or two
SEGMENT_BYTES = 64 << 20
INDEX_NAME = "index.jsonl"

MAX_CACHED_IDS = 4096  # more than a batch holds: cleared at most once per ~4,000 new requests


class _UserIds(dict):
    """internal id -> user id, computed once per id (a C-level dict lookup on hits)."""

    def __missing__(self, internal_id: str) -> str:
        if len(self) >= MAX_CACHED_IDS:  # bounded: a long traced run sees many ids once each (~200 B each)
            self.clear()
        user = self[internal_id] = _SUFFIX.sub("", internal_id)
        return user


# user_req_id(internal_id) -> the id the user gave; hot paths map() it over a batch's ids.
user_req_id = _UserIds().__getitem__


def parse_steps(spec: str) -> set[int] | None:
    """"1-3,7" -> {1,2,3,7}; "" -> None (every step)."""
    spec = spec.strip()
    if not spec:
        return None
    steps: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        steps.update(range(int(lo), int(hi or lo) + 1))
    return steps


def segment_limits() -> tuple[int, int]:
    """(steps, bytes) per records segment, from the environment (defaults SEGMENT_STEPS, SEGMENT_BYTES)."""
    limits = []
    for env, default in ((SEGMENT_STEPS_ENV, SEGMENT_STEPS), (SEGMENT_BYTES_ENV, SEGMENT_BYTES)):
        value = os.environ.get(env) or str(default)
        if not value.isdigit() or int(value) < 1:
            raise TourError(f"{env}={value}: give a whole number above 0")
        limits.append(int(value))
    return limits[0], limits[1]


class Recorder:
    def __init__(self) -> None:
        self.active = False
        self.run_dir: Path | None = None
        self.capture: set[str] = set()
        self.capture_steps: set[int] | None = None
        self.fault: str | None = None
        self.level_rank = levels.rank("full")  # probes of a higher level than the run's stay silent
        self._file = None
        self._pending: list[bytes] = []  # encoded lines of this step not yet written (see write)
        self._procs: dict[tuple, dict] = {}
        self.segment_steps, self.segment_bytes = SEGMENT_STEPS, SEGMENT_BYTES
        self._segment = 0  # number of the segment the next records go to
        self._entry: dict | None = None  # its index entry, once its file is open
        self._steps: list[int] = []  # first and last step of the records in it (pending ones included)
        self._opened_at = 0.0  # wall time it began: activation or the boundary that closed the one before
        self.reset_counters()

    def reset_counters(self) -> None:
        self.sched_step = 0  # Scheduler.schedule calls
        self.worker_step = 0  # model-runner execute_model calls
        self.in_execute = False
        self.rank = 0
        self.kv_pending_freed: list[int] = []
        self.kv_prev_tables: dict[str, list[int]] = {}  # block tables of the previous KV record
        self.kv_prev_step: int | None = None  # its step: the next record's tables are a delta against it
        self.kv_prev_keys: list[str] | None = None  # the KV manager's request ids then, in its order
        self.kv_prev_sizes: list[int] = []  # and the length of each one's block list
        self.kv_freed_since = False  # a request's blocks were freed since then
        self.kv_pending_evicted: list[int] = []
        self.preempted: list = []
        self.sched_prev = None  # the previous scheduler record's (internal ids, user ids, prompts, all "running", prefill)
        self.runner_pending = None
        self.layers_info = None
        self.attn_prev_table = None  # (step, copy of the block-table rows the previous attention record saw in its first rows, their count)
        self.captures: dict[str, object] = {}
        self.capture_meta: dict[str, dict] = {}

    def activate(self, run_dir: Path | str, capture: str = "", capture_steps: str = "", fault: str | None = None,
                 level: str = "full") -> None:
        self.close()
        self.run_dir = Path(run_dir)
        self.capture = {c.strip() for c in capture.split(",") if c.strip()}
        self.capture_steps = parse_steps(capture_steps)
        self.fault = fault or None
        self.level_rank = levels.rank(level)
        self.segment_steps, self.segment_bytes = segment_limits()
        self._segment, self._steps, self._opened_at = 0, [], time.time()
        self.reset_counters()
        self.active = True

    def activate_from_env(self) -> bool:
        run_dir = os.environ.get(RUN_DIR_ENV)
        if not run_dir:
            return False
        if self.active and self.run_dir == Path(run_dir):
            return True
        self.activate(run_dir, os.environ.get(CAPTURE_ENV, ""), os.environ.get(CAPTURE_STEPS_ENV, ""), os.environ.get(FAULT_ENV),
                      os.environ.get(levels.LEVEL_ENV) or "full")
        return True

    def deactivate(self) -> None:
        self.active = False
        self.close()

    def close(self) -> None:
        if self._pending and self.run_dir is not None:
            self.flush()
        self._close_segment(time.time())
        self._pending = []

    def segment_boundary(self, step: int | None) -> None:
        """A point where a new segment may begin: before the first record of `step`, or (None) between two
        records that belong to no step (the front end's). A full segment closes here, and the probes' block
        tables start again from full ones, so that the next segment never needs this one to be read."""
        if self._entry is None or not self._steps:
            return
        if step is not None and step <= self._steps[1]:
            return  # this step has records in the segment already (in-process: the worker after the scheduler)
        full = self._steps[1] - self._steps[0] + 1 >= self.segment_steps or self._entry["bytes"] >= self.segment_bytes
        if not full:
            return
        self.flush()
        self._close_segment(time.time())
        self._segment += 1
        self.kv_prev_step = None
        self.attn_prev_table = None

    def _close_segment(self, now: float) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        entry, self._entry = self._entry, None
        entry.update(first_step=self._steps[0], last_step=self._steps[1], last_time=now)
        self._append_index(entry)
        self._steps, self._opened_at = [], now

    def _append_index(self, entry: dict) -> None:
        # One write() of one short line on an O_APPEND file: the processes of a run append whole lines.
        with open(self.run_dir / INDEX_NAME, "ab", buffering=0) as f:
            f.write(_encode(entry) + b"\n")

    def proc(self, role: str) -> Proc:
        return Proc(role=role, pid=_PID[0], rank=self.rank if role == "worker" else 0)

    def proc_dict(self, role: str) -> dict:
        """A schema.Proc as a dict (hot paths): one per (role, pid, rank), encoded, never mutated."""
        key = (role, _PID[0], self.rank if role == "worker" else 0)
        proc = self._procs.get(key)
        if proc is None:
            proc = self._procs[key] = dict(zip(("role", "pid", "rank"), key))
        return proc

    def write(self, record, flush: bool = True) -> None:
        """Append one record: a schema model, or (on hot paths) a plain dict with the same fields.

        Hot-path probes build dicts because pydantic validation of a 64-request
        batch costs more than the rest of the probe; the reader validates every
        line against the schema, and the golden tests pin the field set.

        `flush=False` keeps the encoded line until the next flushing write (or
        close): a probe that writes two records in one step (scheduler + KV,
        attention + runner) passes it on the first, so the step reaches the file
        in one write() call. Lines are only ever written whole.
        """
        if isinstance(record, dict):
            line, step = _encode(record), record["step"]
        else:
            line, step = record.model_dump_json().encode(), record.step
        self._pending.append(line)
        steps = self._steps
        if not steps:
            steps += (step, step)
        elif step > steps[1]:
            steps[1] = step
        elif step < steps[0]:
            steps[0] = step
            if self._entry is not None:  # an older step's record after the segment's first (async scheduling)
                self._entry["first_step"] = step
                self._append_index(self._entry)
        if flush:
            self.flush()

    def flush(self) -> None:
        """Write the pending lines (one write() call, whole lines only)."""
        if not self._pending:
            return
        if self._file is None:
            assert self.run_dir is not None
            name = f"records.{os.getpid()}.{self._segment:06d}.jsonl"
            while (self.run_dir / name).exists():  # this process wrote to this run before (activated again)
                self._segment += 1
                name = f"records.{os.getpid()}.{self._segment:06d}.jsonl"
            # Unbuffered append, one write() per step: each record reaches the
            # file as a whole line at once, so a killed run leaves a readable trace.
            self._file = open(self.run_dir / name, "ab", buffering=0)
            # last_step None: still being written (or its process was killed): it may hold any later step
            self._entry = {"file": name, "first_step": self._steps[0], "last_step": None,
                           "first_time": self._opened_at, "last_time": None, "bytes": 0}
            self._append_index(self._entry)
        self._pending.append(b"")
        data, self._pending = b"\n".join(self._pending), []
        self._file.write(data)
        self._entry["bytes"] += len(data)

    def probe_error(self, probe, error: Exception, tb: str) -> None:
        try:
            step = self.worker_step if probe.role == "worker" else self.sched_step
            self.write(
                ProbeErrorRecord(
                    step=step,
                    proc=self.proc(probe.role),
                    probe=probe.name,
                    target=probe.target,
                    error=f"{type(error).__name__}: {error}",
                    traceback=tb[-4000:],
                )
            )
        except Exception:
            pass  # a probe error we cannot even write must still not reach the engine

    def target_replaced(self, probe, replaced_by: str, when: str) -> None:
        step = self.worker_step if probe.role == "worker" else self.sched_step
        self.write(ProbeTargetRecord(step=step, proc=self.proc(probe.role), probe=probe.name, target=probe.target,
                                     replaced_by=replaced_by, when=when))

    def keep_capture(self, name: str, tensor, step: int | None = None, **meta) -> None:
        """Keep a copy of `tensor` as capture `name` of this step (default: the worker's) when --capture asks
        for it; copied now, since a probe's tensor may be overwritten in place, and written when the step flushes."""
        step = self.worker_step if step is None else step
        if self.in_execute and self.should_capture(name, step):
            self.captures[name] = tensor.detach().to("cpu", copy=True)
            self.capture_meta[name] = meta

    def should_capture(self, name: str, step: int) -> bool:
        if not self.capture:
            return False
        base = name.split(".", 1)[0]
        if base not in self.capture:
            return False
        return self.capture_steps is None or step in self.capture_steps


# msgspec (a vLLM dependency, and ours) encodes a 64-request record ~10x faster than json.
_encode = msgspec.json.Encoder().encode


RECORDER = Recorder()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so that readers see the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --- which run is "latest" ---------------------------------------------------------------------------
# A pointer file, traces/runs/latest, holding the path of the last run a user command started. It is
# written when the run starts (so a failed or interrupted run is latest too), never inferred from folder
# times: exporting or re-reading an old run writes into its folder and must not make it latest.
LATEST_NAME = "latest"


def mark_latest(runs_dir: Path, run_dir: Path) -> None:
    """Point `runs_dir/latest` at `run_dir`, atomically: a unique temporary file renamed over it, so two
    runs starting at once leave one whole pointer (the later rename), never a mix."""
    import tempfile

    runs_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=runs_dir, prefix=".latest-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(str(Path(run_dir).resolve()) + "\n")
        os.replace(tmp, runs_dir / LATEST_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def allocate_run_dir(parent: Path, name: str) -> Path:
    """Create and return a new, empty run directory `parent/name`, or `name-2`, `name-3`, ... when taken.

    os.mkdir either creates the directory or fails because it exists, atomically: two runs started in
    the same second with the same prompt get two directories, and one never writes into the other's."""
    parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = parent / (name if n == 1 else f"{name}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1
