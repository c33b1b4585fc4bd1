"""`vllm-tour compare`: run the comparisons, print, write JSON, choose the exit code."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vllm_tour.compare import harness, report
from vllm_tour.compare.components import parse_impl
from vllm_tour.compare.reimpl_side import engine_components
from vllm_tour.errors import TourError
from vllm_tour.paths import RUNS_DIR
from vllm_tour.trace.writer import write_json_atomic


def run_compare(module: str, scenario: Path | None, all_scenarios: bool, explain: bool, json_out: Path | None,
                fresh: bool, atol: float | None, rtol: float | None, console: Console, impl_options: list[str] = (),
                upstream_run: Path | None = None) -> int:
    """0: every scenario clean; 1: some diverged; 2 (TourError): could not run.

    impl_options: "COMPONENT=FILE.py[:Name]" each; every file is checked before any engine starts.
    upstream_run: a finished upstream run of the one --scenario (e.g. a GPU run or a golden) instead of running it."""
    from vllm_tour.engine.trace_command import quiet_vllm
    from vllm_tour.paths import check_file

    quiet_vllm(False)  # as `trace`: vLLM's INFO lines would bury the report
    harness.check_module(module)
    impl: dict[str, str] = {}
    for component, spec in map(parse_impl, impl_options):
        if component in impl:
            raise TourError(f"--impl {component} given twice ({impl[component]}, {spec})")
        impl[component] = spec
    engine_components(module, impl)
    paths = harness.scenario_paths(all_scenarios, scenario)
    if upstream_run is not None:
        if scenario is None:
            raise TourError("--upstream-run is a run of one scenario: give it with --scenario FILE")
        if fresh:
            raise TourError("give --upstream-run or --fresh, not both")
        from vllm_tour.trace.reader import load_run

        load_run(Path(upstream_run))  # unreadable: one line, before any engine starts
    out = Path(json_out) if json_out else RUNS_DIR / "compare" / f"{time.strftime('%Y%m%d-%H%M%S')}-{module.replace('.', '_')}.json"
    check_file(out, "JSON report")
    from vllm_tour.scenario import load_scenario

    results, skipped, failed = [], [], []
    for path in paths:
        sc = load_scenario(path)
        why = harness.applicable(sc, module)
        if not why and all_scenarios and path.name.startswith("repro_"):
            why = "a repro scenario (run it with `vllm-tour repro`)"
        if not why and all_scenarios:
            why = harness.cannot_run_here(sc)
        if why:
            if not all_scenarios:
                raise TourError(f"scenario {sc.name}: the reimpl cannot run it: {why}")
            skipped.append({"scenario": sc.name, "path": str(path), "why": why})
            continue
        upstream = ("upstream run " + str(upstream_run) if upstream_run else "running upstream afresh" if fresh
                    else "running upstream (cached per scenario)")
        console.print(f"[dim]{module} · {sc.name}: {upstream} and reimpl…[/]")
        try:
            r = harness.compare(module, path, fresh=fresh, explain=explain, atol=atol, rtol=rtol, impl=impl,
                                upstream_run=upstream_run)
        except TourError as e:
            if not all_scenarios:
                raise
            failed.append({"scenario": sc.name, "path": str(path), "error": str(e)})
            console.print(f"[red]{sc.name}: could not run: {escape(str(e))}[/]")
            continue
        report.render(r, console, explain=explain)
        if upstream_run is None:  # also beside the (cached) upstream run it was compared with; a given run is left as it is
            harness.write_report(r, Path(r.upstream_run) / f"compare-{module.replace('.', '_')}.json")
        results.append(r)

    summary = {
        "module": module,
        "impl": impl,
        "status": "could_not_run" if failed else ("clean" if all(r.clean for r in results) else "diverged"),
        "tolerance": ({"atol": atol, "rtol": rtol} if atol is not None or rtol is not None
                      else {"auto": "per scenario, by upstream's dtype and attention backend (see each scenario's tolerance)"}),
        "scenarios": [r.to_json() for r in results],
        "skipped": skipped,
        "could_not_run": failed,
        "time": time.time(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, summary)

    if len(paths) > 1 or skipped:
        from rich.table import Table

        t = Table(title=f"compare {module}: summary")
        for col in ("scenario", "result", "first divergence", "max |Δ| tensors"):
            t.add_column(col, overflow="fold")
        for r in results:
            f = r.first
            first = f"step {f.step}: {f.field}" if f and f.step is not None else (f.field if f else "-")
            mx = max((s.max_abs for s in r.tensors), default=None)
            t.add_row(r.scenario, "[green]clean[/]" if r.clean else "[red]diverged[/]", escape(first),
                      f"{mx:.1e}" if mx is not None else "-")
        for s in skipped:
            t.add_row(s["scenario"], "[yellow]skipped[/]", s["why"], "-")
        for s in failed:
            t.add_row(s["scenario"], "[red]could not run[/]", escape(s["error"]), "-")
        console.print(t)
    console.print(f"JSON report: {out}")
    if failed:
        raise TourError(f"{len(failed)} scenario(s) could not run (first: {failed[0]['scenario']}: {failed[0]['error']})")
    if not results:
        raise TourError("no scenario could be compared (all skipped)")
    return 0 if all(r.clean for r in results) else 1
