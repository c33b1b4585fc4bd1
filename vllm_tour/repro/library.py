"""`vllm-tour repro --all`: run the library of repros and print one row per repro.

The library is traces/repros/*.toml plus the older traces/scenarios/repro_*.toml.
Each runs on the installed pin (its run directory under traces/runs/); a pin the
file has expectations for that is not installed here is reported, with its
declared verdict, as not run. The table is "as declared" or not: exit 0 when every
verdict that ran matches the file's `verdicts` (REPRODUCED where it declares none).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_tour.engine.upstream_log import summary_line
from vllm_tour.errors import TourError
from vllm_tour.paths import SCENARIOS_DIR, TRACES_DIR
from vllm_tour.scenario import load_scenario

REPROS_DIR = TRACES_DIR / "repros"


def library() -> list[Path]:
    return sorted(REPROS_DIR.glob("*.toml")) + sorted(SCENARIOS_DIR.glob("repro_*.toml"))


def _evidence(res) -> str:
    """One line: the engine's failure when it failed, else the first unmet expectation's evidence
    (when all hold, the last one's: the claim, checked after the requests' own expectations)."""
    if res.failure:
        line = f"engine failed: {res.failure.splitlines()[0]}"
    else:
        c = next((c for c in res.checks if not c.ok), None) or res.checks[-1]
        line = f"{c.key}: {c.evidence[0] if c.evidence else ''}"
    return line  # whole: the table wraps it


def verdict_table(rows: list, all_pins: list[str], here: str, width: int) -> Table:
    """The library's verdicts: a table of columns where it fits (160 columns and up), else one block per
    repro, so that no name, verdict or evidence is cut at 80 columns or in a pipe."""
    table = Table(title=f"repro library on {here}", title_justify="left", show_lines=width < 160,
                  show_header=width >= 160)
    if width >= 160:
        table.add_column("repro", overflow="fold")
        table.add_column("upstream", overflow="fold")
        for p in all_pins:
            table.add_column(p, overflow="fold")
        table.add_column("evidence", overflow="fold", ratio=1)
    else:
        table.add_column("repro", overflow="fold")
    for sc, cells, evidence in rows:
        refs = " ".join(x for x in (f"#{sc.issue}" if sc.issue else "", f"PR #{sc.pr}" if sc.pr else "") if x)
        if width >= 160:
            table.add_row(escape(sc.name), refs, *[cells.get(p, "-") for p in all_pins], escape(evidence))
        else:
            verdicts = "\n".join(f"{p}: {cells.get(p, '-')}" for p in all_pins)
            table.add_row(f"[bold]{escape(sc.name)}[/] {refs}\n{verdicts}" + (f"\n{escape(evidence)}" if evidence else ""))
    return table


def run_all(console: Console, paths: list[Path] | None = None) -> int:
    from vllm_tour.repro.reproduce import installed_pin, run_repro, where_it_runs

    paths = library() if paths is None else paths
    if not paths:
        raise TourError(f"no repros in {REPROS_DIR}")
    here = installed_pin()
    rows, ok = [], True
    for i, path in enumerate(paths, 1):
        sc = load_scenario(path)  # a broken file stops the run: one error line
        pins = sc.pins() or [here]
        cells = {}
        evidence = ""
        if here in pins:
            how = "scheduler only" if sc.mode == "scheduler" else "engine"
            console.print(f"[dim][{i}/{len(paths)}] {escape(sc.name)}: running on {here} ({how})…[/]")
            res = run_repro(path)
            logged = summary_line(res.run_dir, failed=res.failure is not None)
            if logged:
                console.print(f"[dim]      {escape(logged)}[/]", soft_wrap=True)
            mark = "" if res.as_declared else " [bold red](declared " + sc.declared_verdict(here) + ")[/]"
            colour = "green" if res.as_declared else "red"
            cells[here] = f"[{colour}]{res.verdict}[/]{mark}"
            ok &= res.as_declared
            evidence = _evidence(res)
        for p in pins:
            if p != here:
                cells[p] = f"[dim]not run here; declared {sc.declared_verdict(p)}[/]"
        rows.append((sc, cells, evidence))

    all_pins = sorted({p for _, cells, _ in rows for p in cells}, reverse=True)
    table = verdict_table(rows, all_pins, here, console.width)
    console.print(table)
    by_place: dict[str, list[str]] = {}
    for p in all_pins:
        if p != here:
            by_place.setdefault(where_it_runs(p), []).append(p)
    for place, pins in by_place.items():
        console.print(f"[dim]{', '.join(pins)}: {escape(place)}[/]")
    console.print("[bold green]every verdict as declared[/]" if ok else "[bold red]some verdicts differ from their declaration[/]")
    return 0 if ok else 1
