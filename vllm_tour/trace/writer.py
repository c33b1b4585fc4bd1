"""The per-process trace writer: one JSON Lines file per process, flushed per record.

Every vLLM process of a traced run (front end, EngineCore, each worker) gets one
`Recorder`. It is switched on by `activate()` — from the environment in child
processes (the plugin), directly by `run_upstream` in-process — and holds the
step counters and the small per-step scratch state the probes share.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import msgspec

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
        if self._file is not None:
            self._file.close()
            self._file = None
        self._pending = []

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
            line = _encode(record)
        else:
            line = record.model_dump_json().encode()
        self._pending.append(line)
        if flush:
            self.flush()

    def flush(self) -> None:
        """Write the pending lines (one write() call, whole lines only)."""
        if not self._pending:
            return
        if self._file is None:
            assert self.run_dir is not None
            path = self.run_dir / f"records.{os.getpid()}.jsonl"
            # Unbuffered append, one write() per step: each record reaches the
            # file as a whole line at once, so a killed run leaves a readable trace.
            self._file = open(path, "ab", buffering=0)
        self._pending.append(b"")
        data, self._pending = b"\n".join(self._pending), []
        self._file.write(data)

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
