"""What `vllm-tour trace/show/export` do, behind the thin CLI: build the scenario, run, summarize."""

from __future__ import annotations

import functools
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from vllm_tour.engine.upstream_log import LOG_NAME, VERBOSE_ENV, summary_line
from vllm_tour.errors import TourError
from vllm_tour.scenario import Scenario, load_scenario, scenario_from_dict
from vllm_tour.trace.levels import DEFAULT_LEVEL, check_level
from vllm_tour.trace.levels import has as has_level


def build_scenario(
    scenario_file: Path | None,
    prompts: list[str],
    requests_file: Path | None,
    model: str | None,
    pin: str | None,
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    ignore_eos: bool,
    engine: dict,
    chat: bool = False,
) -> Scenario:
    """A scenario from a file, from --request prompts, or a file overridden by flags; with `chat`, its
    text prompts in the model's chat template (chat.apply_chat)."""
    prompts = list(prompts)
    if requests_file is not None:
        prompts += _read_requests_file(requests_file)
        if not prompts:
            raise TourError(f"requests file {requests_file} has no prompts (one per line)")
    if scenario_file is None and not prompts:
        raise TourError("nothing to run: give --request TEXT (repeatable), --requests-file FILE or --scenario FILE.toml")
    if scenario_file is not None:
        data = load_scenario(scenario_file).model_dump(exclude_none=True)
    else:
        data = {"name": _slug(prompts[0]), "requests": []}
    if prompts:  # prompts from the command line replace the scenario's requests
        data["requests"] = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(prompts)]
    for r in data["requests"]:
        if max_tokens is not None:
            r["max_tokens"] = max_tokens
        if temperature is not None:
            r["temperature"] = temperature
        if seed is not None:
            r["seed"] = seed
        if ignore_eos:
            r["ignore_eos"] = True
    if model:
        data["model"] = model
    if pin:
        data["pin"] = pin
    data["engine"] = {**data.get("engine", {}), **{k: v for k, v in engine.items() if v is not None}}
    sc = scenario_from_dict(data, "trace options")
    if chat:
        from vllm_tour.upstream.chat import apply_chat

        sc = apply_chat(sc)
    return sc


def _read_requests_file(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file; anything else is one TourError line saying what is wrong."""
    if path.is_dir():
        raise TourError(f"requests file {path} is a directory (give a text file with one prompt per line)")
    if not path.exists():
        raise TourError(f"requests file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise TourError(f"requests file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line}): "
                        "save it as UTF-8, one prompt per line") from None
    except OSError as e:
        raise TourError(f"cannot read requests file {path}: {e.strerror or e}") from None
    return [line for line in text.splitlines() if line.strip()]


def _slug(text: str) -> str:
    words = "".join(c if c.isalnum() else " " for c in text).split()
    return "-".join(words[:4]).lower() or "prompt"


def check_out(out: Path | None, force: bool) -> None:
    """A rerun into an existing run dir replaces its records: only with --force."""
    if out is not None and out.is_dir() and any(out.iterdir()) and not force:
        raise TourError(f"--out {out} exists and is not empty (a trace replaces its meta.json, records and captures): "
                        "give --force to replace them, or another --out")


def trace(scenario: Scenario, out: Path | None, capture: list[str], capture_steps: str, multiprocess: bool, console: Console,
          logprobs: int | None = None, force: bool = False, level: str | None = None) -> Path:
    """`level` None: full when tensors are captured (the probes that take them need it), else the default."""
    from vllm_tour.engine.run import run_upstream
    from vllm_tour.trace.reader import load_run

    check_out(out, force)
    level = check_level(level) if level else ("full" if capture else DEFAULT_LEVEL)

    started = time.time()
    total = len(scenario.requests)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"), TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(f"starting upstream vLLM ({scenario.model})…", total=total)

        def progress(step: int, done: int, total: int) -> None:
            bar.update(task, completed=done, description=f"step {step}")

        with says_where_when_interrupted():
            run_dir = run_upstream(scenario, out, capture, progress, multiprocess=multiprocess, capture_steps=capture_steps,
                                   logprobs=logprobs, level=level, latest=True)
    run = load_run(run_dir)
    summarize(run, time.time() - started, console)
    return run_dir


@contextmanager
def says_where_when_interrupted():
    """Ctrl-C in a run (engine.run.Interrupted): no traceback, one line saying where the partial run is (its
    meta says "interrupted"; it stays readable), exit 130. SystemExit, not KeyboardInterrupt: Typer turns the
    latter into a bare exit 130 before we could speak."""
    try:
        yield
    except KeyboardInterrupt as e:
        run_dir = getattr(e, "run_dir", None)
        if run_dir is None:  # before a run dir existed: nothing to point at
            raise
        where = display_path(run_dir)
        print(f"interrupted: the partial run is in {where} (vllm-tour show {where})", file=sys.stderr)
        raise SystemExit(130) from None


def _since_process_start() -> float | None:
    """Seconds since this process started: what the user waited, imports and model set-up included
    (Linux /proc; None elsewhere)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def summarize(run, elapsed: float, console: Console) -> None:
    print_ = functools.partial(console.print, highlight=False)
    steps = run.steps
    preempt = [(s.index, p.req_id) for s in steps if s.scheduler for p in s.scheduler.preempted]
    hits = [(s.index, h.req_id, h.num_hit_tokens) for s in steps if s.kv for h in s.kv.prefix_hits]
    gen = sum(len(o.token_ids) for o in run.outputs.requests) if run.outputs else 0
    peak = max((s.kv.usage for s in steps if s.kv), default=0.0)
    batch = max((len(s.scheduler.scheduled) for s in steps if s.scheduler), default=0)
    waited = _since_process_start()
    took = f"in {waited:.1f}s (the engine run {elapsed:.1f}s of it)" if waited else f"in {elapsed:.1f}s"
    print_(f"[bold]traced[/] {len(run.meta.requests)} request(s), {len(steps)} steps, {gen} tokens generated {took} (pin {run.meta.pin}, {run.meta.model})")
    kv = f"peak KV usage {peak:.1%} · " if has_level(run.meta.level, "blocks") else ""
    hit = f" · prefix-cache hits {len(hits)}" if has_level(run.meta.level, "blocks") else ""
    print_(f"  level {run.meta.level} · largest batch {batch} · {kv}preemptions {len(preempt)}{hit}")
    for i, rid in preempt[:3]:
        print_(f"  step {i}: preempted {rid}")
    for i, rid, n in hits[:3]:
        print_(f"  step {i}: {rid} reused {n} cached tokens")
    if run.outputs:
        for o in run.outputs.requests[:4]:
            print_(escape(f"  {o.req_id}: {len(o.token_ids)} tokens → {o.text[:50]!r}"))
        if run.meta.weights_note:
            print_(f"  [dim]{escape(run.meta.weights_note)}[/]")
    if run.errors:
        print_(f"  [bold red]{len(run.errors)} probe error(s)[/]: " + escape(f"{run.errors[0].probe}: {run.errors[0].error}"))
    for w in run.warnings:
        print_("  [yellow]warning:[/] " + escape(w))
    where = display_path(run.path)
    print_(f"  run dir: {where}")
    logged = summary_line(run.path, failed=False, where=f"{where}/{LOG_NAME}")
    if logged:
        print_(f"  [dim]{escape(logged)}[/]")
    print_(f"  see it:  vllm-tour show {where}  (--step N, --request ID)")
    print_(f"  export:  vllm-tour export {where} --format perfetto")


def display_path(path: Path) -> str:
    """The run dir as the user would type it: relative when under the current directory."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def quiet_vllm(verbose: bool) -> None:
    """vLLM logs INFO lines from every process; the tour's own display is enough by default, and what upstream
    writes during a run goes to the run's upstream.log (upstream_log.py). --verbose shows it all live."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    else:
        import warnings

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
