"""The spool: a helper process that finishes a traced process's records and writes them to its file.

Every microsecond a probe spends on the engine's thread lengthens the step (measured: the CPU engine hides
none of it, the H200's ~200 us). So the traced process hands its step over as it read it: encoded lines
(the scheduler and KV records) and the worker's raw arrays, copied into a ring in shared memory (a memcpy,
no system call). The helper, at idle priority on another core, builds the runner and attention records from
the arrays (probes/worker_records.py: the block-table diff, the slot mapping, the lists) and makes the
write() calls. Records reach the file in the order the process wrote them, within milliseconds.

Nothing is lost when the traced process dies: what it put in the ring is there, and the helper writes it all
before it exits. Readers of a run wait for both (`wait_for_writers`): each holds a lock on the records file
until it is done. The helper gone early (killed), the traced process writes what is left itself and goes on
without one. Off (`VLLM_TOUR_SPOOL=0`), with tensor captures (they need the slot mapping in the process)
and off Linux x86-64 (the ring relies on x86's store order): everything happens in the traced process.

Ring layout: three 8-byte counters (bytes written, bytes read — both counted from the start, skipped
tails included — and a closed flag), then the buffer. A message is a 4-byte length and its bytes; one that
does not fit before the buffer's end starts over at its beginning. A message is one hand-over's frames,
each [4-byte payload length][1-byte kind][payload]: kind LINES, JSON lines joined by newlines; kind RAW, a
4-byte length, msgpack of [header, [dtype char, bytes (or the length of bytes after it)] per array], then the big
arrays' bytes (arrays are 1-D; a block table's row length is in its header).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import signal
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

import msgspec
import numpy as np

SPOOL_ENV = "VLLM_TOUR_SPOOL"  # "0": no helper process
RING_ENV = "VLLM_TOUR_SPOOL_BYTES"  # the ring's size (tests: a small ring wraps often)
RING_BYTES = 4 << 20  # 15 steps of 256 sequences on the H200 (its block table is 256 KiB), ~400 on the CPU bench
HEADER = 64
WRAP = 0xFFFFFFFF  # a length that says: the message starts over at the buffer's beginning
LINES, RAW = 0, 1
POLL_S = 0.005  # the helper looks at the ring this often (records reach the file within 20 ms)
STALL_S = 30.0  # the helper alive but not reading for this long: taken for stuck
_U32 = struct.Struct("<I")
_FRAME = struct.Struct("<IB")  # payload length, kind
_RAW = struct.Struct("<IBI")  # payload length, kind, msgpack header length
BIG = 1 << 15  # arrays larger than this skip msgpack (see frames)
_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder().decode
_encode = msgspec.json.Encoder().encode


def wanted(capture: set[str]) -> bool:
    return (os.environ.get(SPOOL_ENV, "1") != "0" and not capture and sys.platform == "linux"
            and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create"))


def frames(lines: list[bytes], header: list | None = None, arrays: list = ()) -> tuple[list, int]:
    """One message as (parts, its length): the pending lines as one LINES frame, then a worker hook's header and
    arrays as a RAW frame. Arrays are copied out now (the engine reuses its buffers): a small one into the
    header's msgpack, a big one (the H200's 256 KiB block table) into the ring by Ring.put, once."""
    first = b""
    if lines:
        data = b"\n".join(lines)
        first = _FRAME.pack(len(data), LINES) + data
    if header is None:
        return [first], len(first)
    specs, big, tail = [], [], 0
    for a in arrays:
        if a.nbytes > BIG:
            specs.append((a.dtype.char, a.nbytes))
            big.append(a)
            tail += a.nbytes
        else:
            specs.append((a.dtype.char, a.tobytes()))
    data = _pack((header, specs))
    first += _RAW.pack(4 + len(data) + tail, RAW, len(data)) + data
    return [first, *big], len(first) + tail


def _raw_records(payload: bytes, worker) -> list[bytes]:
    (hlen,) = _U32.unpack_from(payload)
    header, specs = _unpack(payload[4 : 4 + hlen])
    arrays, offset = [], 4 + hlen
    for char, data in specs:
        if type(data) is int:  # a big array's bytes, after the header
            data, offset = payload[offset : offset + data], offset + data
        arrays.append(np.frombuffer(data, char))
    try:
        return list(map(_encode, worker.handle(header, arrays)))
    except Exception as e:  # the probe's error, written where the record would have been
        return [_error_line(header, e)]


def _error_line(header: list, error: Exception) -> bytes:
    from ..probes.worker_records import PROBES
    from .schema import Proc, ProbeErrorRecord

    kind, proc, step = header[:3]
    name, target = PROBES[kind] if kind in PROBES else (header[3][-2], header[3][-1])
    return ProbeErrorRecord(step=step, proc=Proc(**proc), probe=name, target=target, error=f"{type(error).__name__}: {error}",
                            traceback=traceback.format_exc()[-4000:]).model_dump_json().encode()


def process(msg: bytes, worker) -> bytes:
    """One ring message's frames as the lines of the records file."""
    lines, i = [], 0
    while i < len(msg):
        n, kind = _FRAME.unpack_from(msg, i)
        i += 5
        if kind == LINES:
            lines.append(msg[i : i + n])
        else:
            lines += _raw_records(msg[i : i + n], worker)
        i += n
    return b"".join(line + b"\n" for line in lines)


class Ring:
    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.size = len(mm) - HEADER
        self.counters = memoryview(mm).cast("Q")  # aligned 8-byte stores and loads: never seen half-written

    def put(self, parts: list, total: int) -> bool:
        """Append one message made of `parts` (bytes, C-contiguous arrays; `total` bytes); False when it does
        not fit now."""
        mm, size, c = self.mm, self.size, self.counters
        written, need = c[0], 4 + total
        off = written % size
        if size - off < need:  # start over at the beginning: the tail is skipped (the reader's skip published now)
            if written + size - off - c[1] > size:
                return False  # the reader is still in the tail's bytes of the lap before
            if size - off >= 4:
                _U32.pack_into(mm, HEADER + off, WRAP)
            written += size - off
            c[0], off = written, 0
        if written + need - c[1] > size:
            return False
        pos = HEADER + off
        _U32.pack_into(mm, pos, total)
        pos += 4
        for part in parts:
            end = pos + (len(part) if type(part) is bytes else part.nbytes)
            mm[pos:end] = part
            pos = end
        c[0] = written + need  # published after the bytes: x86 makes stores visible in program order
        return True

    def take(self) -> tuple[list[bytes], int]:
        """The messages not read yet (copies), and the read count once they are (see `done`)."""
        mm, size, c = self.mm, self.size, self.counters
        written, read = c[0], c[1]
        messages = []
        while read < written:
            off = read % size
            tail = size - off
            if tail < 4:
                read += tail
                continue
            (n,) = _U32.unpack_from(mm, HEADER + off)
            if n == WRAP:
                read += tail
                continue
            messages.append(mm[HEADER + off + 4 : HEADER + off + 4 + n])
            read += 4 + n
        return messages, read

    def done(self, read: int) -> None:
        self.counters[1] = read

    @property
    def closed(self) -> bool:
        return bool(self.counters[2])

    def close(self) -> None:
        self.counters[2] = 1


# The helper's command: idle priority first (it runs only where the engine leaves a core idle), its imports after.
_HELPER = """
import os
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
from vllm_tour.trace.spool import main
main()
"""


class Spool:
    """The traced process's side: starts the helper on its records file and hands it each flush."""

    def __init__(self, records_fd: int) -> None:
        size = int(os.environ.get(RING_ENV, RING_BYTES))
        ring_fd = os.memfd_create("vllm-tour-spool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(ring_fd, HEADER + size)
            # Mapped in now (MAP_POPULATE, ~1 ms): a first write to each page would fault on the engine's thread.
            self.ring = Ring(mmap.mmap(ring_fd, HEADER + size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)))
            root = str(Path(__file__).resolve().parents[2])  # vllm_tour's parent: the helper imports it from there
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
            self.proc = subprocess.Popen([sys.executable, "-c", _HELPER, str(ring_fd), str(records_fd), str(os.getpid())],
                                         pass_fds=(ring_fd, records_fd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        finally:
            os.close(ring_fd)  # the mapping stays
        self.cpu_s = 0.0  # the helper's CPU time, once it exited
        self.exited = False

    def put(self, parts: list, total: int) -> bool:
        """Hand over one message; waits while the ring is full. False: the helper is gone (or stuck, and killed)."""
        if self.ring.put(parts, total):
            return True
        if 4 + total > self.ring.size:
            return False
        deadline = time.monotonic() + STALL_S
        while not self.ring.put(parts, total):
            if self._reaped() or time.monotonic() > deadline:
                self._kill()
                return False
            time.sleep(0.0002)
        return True

    def close(self, timeout: float = 60.0) -> list[bytes]:
        """Tell the helper to finish; wait for it. Returns the messages it left unwritten (it died early)."""
        self.ring.close()
        deadline = time.monotonic() + timeout
        while not self._reaped():
            if time.monotonic() > deadline:
                self._kill()
                break
            time.sleep(0.001)
        return self.leftovers()

    def leftovers(self) -> list[bytes]:
        messages, read = self.ring.take()
        self.ring.done(read)
        return messages

    def cpu_time(self) -> float:
        """The helper's CPU seconds so far."""
        if not self.exited:
            try:
                with open(f"/proc/{self.proc.pid}/schedstat") as f:
                    return int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                pass
        return self.cpu_s

    def _reaped(self) -> bool:
        if not self.exited:
            try:
                pid, _, usage = os.wait4(self.proc.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (its CPU time unknown)
                self.exited = True
                return True
            if pid:
                self.exited, self.proc.returncode = True, 0
                self.cpu_s = usage.ru_utime + usage.ru_stime
        return self.exited

    def _kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        while not self._reaped():
            time.sleep(0.001)


def wait_for_writers(run_dir: Path, timeout: float = 120.0) -> list[str]:
    """Wait until no process (nor its helper) is still writing a records file of `run_dir`: each holds a lock
    on the file until it is done. Returns the files still locked after `timeout` seconds."""
    deadline, late = time.monotonic() + timeout, []
    for path in sorted(Path(run_dir).glob("records.*.jsonl")):
        fd = os.open(path, os.O_RDONLY)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        late.append(path.name)
                        break
                    time.sleep(0.005)
        finally:
            os.close(fd)
    return late


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main() -> None:
    """The helper (see _HELPER), with arguments RING_FD RECORDS_FD PARENT_PID."""
    from ..probes.worker_records import WorkerRecords

    ring_fd, out_fd, parent = map(int, sys.argv[1:4])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    ring = Ring(mmap.mmap(ring_fd, 0))
    os.close(ring_fd)
    worker, delay = WorkerRecords(), POLL_S
    while True:
        messages, read = ring.take()
        if messages:
            _write_all(out_fd, b"".join(process(m, worker) for m in messages))
            ring.done(read)
            delay = POLL_S
        elif ring.closed or os.getppid() != parent:
            if ring.counters[0] == read:  # nothing was put between the last take and the close (or the death)
                break
            continue
        else:
            delay = min(2 * delay, 4 * POLL_S)  # idle: look less often
        time.sleep(delay)  # a few steps per look: each look costs a wake-up
