"""`vllm-tour watch`: a live view of a run being written (a `trace` or a `serve` run).

Each tick re-reads the end of the run directory: its last TAIL_STEPS steps, from the segments that hold
them, so a run traced for hours costs no more per tick than a short one (the reader merges every process's
records and skips a line still being written). It draws the step rate, the queues of the last step, KV
usage with the block grid, the last preemptions and prefix-cache hits. It ends by itself when meta.json
says the run is over (ok, failed, interrupted), drawing the final picture once more; a run that is
already over is drawn once.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from vllm_tour.trace import levels
from vllm_tour.trace.reader import Run, load_tail
from vllm_tour.views.show import block_grid

REFRESH_S = 0.5  # at least twice a second
RATE_WINDOW_S = 5.0  # the step rate is over the steps of the last seconds (record times)
EVENTS_SHOWN = 5
TAIL_STEPS = 500  # read each tick: enough for the events shown and the rate at tens of steps a second


def step_rate(run: Run, window_s: float = RATE_WINDOW_S) -> float | None:
    """Steps per second over the last `window_s` seconds of scheduler record times (None: too few steps)."""
    times = [s.scheduler.time for s in run.steps if s.scheduler is not None]
    if len(times) < 2:
        return None
    recent = [t for t in times if t >= times[-1] - window_s]
    if len(recent) < 2 or recent[-1] == recent[0]:
        recent = times  # slower than one step per window: the whole run's rate
    return (len(recent) - 1) / (recent[-1] - recent[0]) if recent[-1] > recent[0] else None


def recent_events(run: Run, n: int = EVENTS_SHOWN) -> list[str]:
    """The last preemptions, prefix-cache hits, aborts and finishes, newest last."""
    events = []
    for s in run.steps:
        sc, kv = s.scheduler, s.kv
        if sc:
            events += [f"step {s.index}: preempted {p.req_id} ({p.reason})" for p in sc.preempted]
            events += [f"step {s.index}: {rid} finished" for rid in sc.finished]
        if kv:
            events += [f"step {s.index}: {h.req_id} hit {h.num_hit_tokens} cached tokens" for h in kv.prefix_hits]
        events += [f"step {s.index}: {a.req_id} aborted by its client" for a in s.aborts]
    return events[-n:]


def frame(run: Run) -> Group:
    """One picture of the run as it stands."""
    m = run.meta
    rate = step_rate(run)
    last = run.steps[-1] if run.steps else None
    head = Text(f"{run.path.name} · pin {m.pin} · {m.model} · level {m.level} · {m.status}\n", style="bold")
    waiting = "rate: waiting for steps" if m.status == "running" else "rate: no step times (a golden keeps none)"
    head.append(f"{last.index if last else 0} steps · " + (f"{rate:.1f} steps/s" if rate else waiting))
    parts: list = [head]
    if last is not None and last.scheduler is not None:
        sc = last.scheduler
        parts.append(Text(f"step {last.index}: running {sc.running_after}, waiting {sc.waiting_after}, "
                          f"{sc.tokens_scheduled}/{sc.token_budget} tokens scheduled"))
    if last is not None and last.kv is not None:
        kv = last.kv
        used = kv.num_blocks - kv.free_blocks
        bar = "█" * round(20 * used / max(kv.num_blocks, 1))
        parts.append(Text(f"KV {used}/{kv.num_blocks} blocks in use [{bar:<20}] {kv.usage:.0%}"))
        parts.append(block_grid(run, last))
    elif last is not None:
        parts.append(Text(levels.missing_line(m.level, "blocks", "KV usage and the block grid") or "", style="yellow"))
    events = recent_events(run)
    if events:
        parts.append(Text("recent:\n  " + "\n  ".join(events), style="dim"))
    return Group(*parts)


def watch(path: str | Path, console: Console, interval: float = REFRESH_S, max_seconds: float | None = None) -> Run:
    """Draw the run until it is over (or `max_seconds` pass); returns the last reading."""
    run = load_tail(path, TAIL_STEPS)
    started = time.monotonic()
    with Live(frame(run), console=console, refresh_per_second=max(2, round(1 / interval)), transient=False) as live:
        while run.meta.status == "running":
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                break
            time.sleep(interval)
            run = load_tail(run.path, TAIL_STEPS)
            live.update(frame(run))
    if not console.is_terminal:
        console.line()  # a pipe gets the last frame without its closing newline
    console.print(Text(f"{run.path.name}: {run.meta.status}, {run.steps[-1].index if run.steps else 0} steps", style="bold"))
    return run
