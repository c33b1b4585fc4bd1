"""The per-process trace writer: one JSON Lines file per process, flushed once per step.

Every vLLM process of a traced run (front end, EngineCore, each worker) gets one
`Recorder`. It is switched on by `activate()` — from the environment in child
processes (the plugin), directly by `run_upstream` in-process — and holds the
step counters and the small per-step scratch state the probes share. A flush
hands the step to the process's spool helper (spool.py), or writes it here.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import msgspec

from ..probes.worker_records import WorkerRecords
from . import spool
from .req_ids import MAX_CACHED_IDS, user_req_id  # noqa: F401 - imported from here by the probes
from .schema import Proc, ProbeErrorRecord, ProbeTargetRecord

RUN_DIR_ENV = "VLLM_TOUR_RUN_DIR"
CAPTURE_ENV = "VLLM_TOUR_CAPTURE"  # comma-separated capture names
CAPTURE_STEPS_ENV = "VLLM_TOUR_CAPTURE_STEPS"  # "1-3,7"; empty: every step
FAULT_ENV = "VLLM_TOUR_FAULT"  # a probe name: that probe raises (tests)

# This process's id, read once (getpid() is a system call, four records a step ask for it) and again in a
# forked child.
_PID = [os.getpid()]


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
        self._file = None
        self._pending: list[bytes] = []  # encoded lines of this step not yet written (see write)
        self._procs: dict[tuple, dict] = {}
        self._spool: spool.Spool | None = None  # the helper writing this activation's records, once started
        self._spooled = False  # records go through a helper (decided at activation, see spool.wanted)
        self.helper_cpu_s = 0.0  # CPU time of this process's helpers that exited (benchmarks report it)
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
        self.runner_pending = None  # (step, tokens scheduled) of the worker step under way
        self.host_runner = None  # its model runner, when its prepare message gave the host state (runner.py)
        self.attn_static: dict[int, list] = {}  # id(metadata builder) -> its attention record's fixed fields
        self.attn_width: dict[int, int] = {}  # id(a runner's host block table) -> columns ever written (attention.py)
        self.layers_info = None
        self.worker = WorkerRecords()  # builds the runner and attention records here when there is no helper
        self.captures: dict[str, object] = {}
        self.capture_meta: dict[str, dict] = {}

    def activate(self, run_dir: Path | str, capture: str = "", capture_steps: str = "", fault: str | None = None) -> None:
        self.close()
        self.run_dir = Path(run_dir)
        self.capture = {c.strip() for c in capture.split(",") if c.strip()}
        self.capture_steps = parse_steps(capture_steps)
        self.fault = fault or None
        self.reset_counters()
        self._spooled = spool.wanted(self.capture)
        self.active = True

    def activate_from_env(self) -> bool:
        run_dir = os.environ.get(RUN_DIR_ENV)
        if not run_dir:
            return False
        if self.active and self.run_dir == Path(run_dir):
            return True
        self.activate(run_dir, os.environ.get(CAPTURE_ENV, ""), os.environ.get(CAPTURE_STEPS_ENV, ""), os.environ.get(FAULT_ENV))
        return True

    def deactivate(self) -> None:
        self.active = False
        self.close()

    def close(self) -> None:
        if self._pending and self.run_dir is not None:
            self.flush()
        if self._spool is not None:
            self._without_helper(self._spool.close())
        if self._file is not None:
            self._file.close()  # releases the lock readers wait on (spool.wait_for_writers)
            self._file = None
        self._pending = []

    def forked(self) -> None:
        """In a forked child: the parent's file and helper are the parent's (the child opens its own)."""
        _PID[0] = os.getpid()
        self._file, self._spool, self._pending = None, None, []

    def proc(self, role: str) -> Proc:
        return Proc(role=role, pid=os.getpid(), rank=self.rank if role == "worker" else 0)

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

    def send(self, header: list, arrays: list, flush: bool = False) -> None:
        """A worker hook's read of the step (probes/worker_records.py): to the helper as it is, the arrays
        copied into its ring now (the engine reuses its buffers); without a helper, made into records here."""
        if self._spooled and self._spool_ready():
            if self._spool.put(*spool.frames(self._pending, header, arrays)):
                self._pending = []
                return
            self._without_helper(self._spool.leftovers())
        self._pending += map(_encode, self.worker.handle(header, arrays))
        if flush:
            self.flush()

    def flush(self) -> None:
        """Hand the pending lines to the helper, or write them (one write() call, whole lines only)."""
        if not self._pending:
            return
        if self._spooled and self._spool_ready():
            if self._spool.put(*spool.frames(self._pending)):
                self._pending = []
                return
            self._without_helper(self._spool.leftovers())
        self._open()
        self._pending.append(b"")
        data, self._pending = b"\n".join(self._pending), []
        self._file.write(data)

    def _open(self) -> None:
        if self._file is None:
            assert self.run_dir is not None
            path = self.run_dir / f"records.{os.getpid()}.jsonl"
            # Unbuffered append, one write() per step: each record reaches the file as a whole line at
            # once, so a killed run leaves a readable trace. Locked until closed: see spool.wait_for_writers.
            self._file = open(path, "ab", buffering=0)
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)

    def helper_cpu(self) -> float:
        """CPU seconds of this process's spool helpers so far (benchmarks report it)."""
        return self.helper_cpu_s + (self._spool.cpu_time() if self._spool is not None else 0.0)

    def _spool_ready(self) -> bool:
        """Whether a helper takes this flush (started at the first one)."""
        if self._spool is None:
            self._open()
            try:
                self._spool = spool.Spool(self._file.fileno())
            except OSError:  # no helper: the records are written here
                self._spooled = False
                return False
        return True

    def _without_helper(self, leftovers: list[bytes]) -> None:
        """The helper is gone: write what it left in the ring, and from now on write here."""
        self.helper_cpu_s += self._spool.cpu_s
        self._spool, self._spooled = None, False
        if leftovers:
            self._open()
            self._file.write(b"".join(spool.process(m, self.worker) for m in leftovers))

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
os.register_at_fork(after_in_child=RECORDER.forked)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so that readers see the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
