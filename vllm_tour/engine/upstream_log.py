"""Upstream's own output during a run goes to the run's upstream.log; the terminal gets one line about it.

What upstream writes is much and mostly expected: vLLM's log lines (on stdout), every process's stderr
(Triton and NUMA warnings, a crashed worker's 400-line backtrace in the EP repro). While upstream runs,
this process's file descriptors 1 and 2 point at a spool file, so vLLM's logger, C++ warnings and every
process vLLM starts (EngineCore, workers: they inherit the descriptors) write there; `sys.stdout` points
at a copy of the terminal's descriptor, so the tour's own display (the progress bar) still shows. The
spool becomes <run>/upstream.log once the run dir exists (the checks before an engine starts import vLLM,
which logs at import, before there is a run dir; a run that never got one leaves no log).

`--verbose` (VLLM_TOUR_VERBOSE=1) leaves everything on the terminal, live.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LOG_NAME = "upstream.log"
VERBOSE_ENV = "VLLM_TOUR_VERBOSE"
# vLLM's handler resolves its stream when it is configured (at import, again at engine start): the real
# stdout, descriptor 1, never the terminal copy that sys.stdout is during a run.
STREAM_ENV = {"VLLM_LOGGING_STREAM": "ext://sys.__stdout__"}
SHOWN_CHARS = 160  # of the first error line in the summary

_ERROR = re.compile(r"\bERROR \d\d-\d\d |^\[E\d{4} |Segfault encountered|^Fatal Python error|^Traceback \(most recent")
_WARNING = re.compile(r"\bWARNING \d\d-\d\d |^\[W\d{4} |\w*Warning: ")
_VLLM_PREFIX = re.compile(r"^.*?\b(ERROR|WARNING) \d\d-\d\d [\d:]+ \[[^\]]*\] ")


def live() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class Spool:
    """Where upstream's output goes during a run; keep_in(run_dir) names the run it belongs to."""

    def __init__(self):
        self.run_dir: Path | None = None

    def keep_in(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)


@contextmanager
def upstream_output():
    """Upstream's output into the run's upstream.log for the duration (see the module's doc)."""
    if live():
        yield Spool()
        return
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if s is not None:
            s.flush()
    with tempfile.TemporaryFile() as file:
        spool = Spool()
        try:
            with _descriptors_to(file):
                yield spool
        finally:  # a failed run keeps its log too: it is where the failure's details are
            if spool.run_dir is not None and spool.run_dir.is_dir():
                file.seek(0)
                with open(spool.run_dir / LOG_NAME, "wb") as f:
                    shutil.copyfileobj(file, f)


@contextmanager
def _descriptors_to(file):
    """Descriptors 1 and 2 into `file`, sys.stdout to the terminal, for the duration."""
    saved_out, saved_err = os.dup(1), os.dup(2)
    terminal = io.TextIOWrapper(os.fdopen(os.dup(saved_out), "wb"), errors="replace", line_buffering=True,
                                encoding=getattr(sys.stdout, "encoding", None) or "utf-8")
    old_stdout, old_stderr, old_stream = sys.stdout, sys.stderr, os.environ.get("VLLM_LOGGING_STREAM")
    os.environ.update(STREAM_ENV)
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    # In-process Python warnings go to sys.stderr: to the spool too (a progress bar may have proxied it to the screen)
    sys.stdout, sys.stderr = terminal, sys.__stderr__ or old_stderr
    try:
        yield
    finally:
        for s in (sys.__stdout__, sys.__stderr__):
            if s is not None:
                s.flush()
        sys.stdout, sys.stderr = old_stdout, old_stderr
        terminal.close()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        if old_stream is None:
            os.environ.pop("VLLM_LOGGING_STREAM", None)
        else:
            os.environ["VLLM_LOGGING_STREAM"] = old_stream


@dataclass
class LogCounts:
    path: Path
    errors: int
    warnings: int
    first_error: str | None  # the first error line, its vLLM prefix (process, level, time, file) cut


def read_log(run_dir: Path) -> LogCounts | None:
    """The run's upstream.log counted; None when the run has none (a --verbose run, an older one)."""
    path = Path(run_dir) / LOG_NAME
    if not path.is_file():
        return None
    errors = warnings = 0
    first = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if _ERROR.search(line):
            errors += 1
            first = first or _VLLM_PREFIX.sub("", line).strip(" !")
        elif _WARNING.search(line):
            warnings += 1
    return LogCounts(path, errors, warnings, first)


def summary_line(run_dir: Path, failed: bool, where: str | None = None) -> str | None:
    """"upstream logged 2 errors, 3 warnings: see RUN/upstream.log", and, for a failed run, its first error
    line, shortened. None when there is nothing to say: no log or an empty one, or no error or warning in it
    and the run went as expected."""
    counts = read_log(run_dir)
    if counts is None or not counts.path.stat().st_size or not (counts.errors or counts.warnings or failed):
        return None
    where = where or str(counts.path)
    n = f"{counts.errors} error{'s' * (counts.errors != 1)}, {counts.warnings} warning{'s' * (counts.warnings != 1)}"
    line = f"upstream logged {n}: see {where}"
    if failed and counts.first_error:
        first = counts.first_error
        line += f" (first: {first[:SHOWN_CHARS]}{'…' if len(first) > SHOWN_CHARS else ''})"
    return line
