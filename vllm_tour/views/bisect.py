"""`repro FILE --bisect`'s report: the verdict per release, the release where it changed, and `diff` of the two
releases' traces (the first step where the upstream engine decided otherwise)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_tour.repro.bisect import Bisect
from vllm_tour.trace.reader import load_run
from vllm_tour.views import diff


def render(res: Bisect, console: Console) -> int:
    """Print the report; exit code 0 when the verdict changed somewhere, 1 when every release agrees."""
    table = Table(title=f"{res.name}: verdict per release, oldest first", title_justify="left")
    for col in ("release", "verdict", "time", "where"):
        table.add_column(col, overflow="fold")
    for t in res.tried:
        verdict = t.cell.verdict + (f": {t.cell.detail}" if t.cell.detail and not t.has_verdict else "")
        table.add_row(t.release.tag, escape(verdict), f"{t.cell.seconds:.0f} s", escape(t.release.where))
    console.print(table)
    console.print(escape(f"runs: {res.root}"), soft_wrap=True, highlight=False)
    changes = res.changes()
    judged = [t for t in res.tried if t.has_verdict]
    if not changes:
        if len(judged) < 2:
            console.print(f"no verdict to compare: {len(judged)} release(s) gave one")
        else:
            console.print(escape(f"no change: {judged[0].cell.verdict} on every release that ran "
                                 f"({', '.join(t.release.tag for t in judged)})"), highlight=False)
        return 1
    for a, b in changes:
        console.print(escape(f"changed in {b.release.tag}: {a.cell.verdict} on {a.release.tag} -> {b.cell.verdict} on "
                             f"{b.release.tag}"), highlight=False)
    a, b = changes[0]
    console.print(escape(f"\n$ vllm-tour diff {a.run_dir} {b.run_dir}"), soft_wrap=True, highlight=False)
    diff.render(diff.diff_runs(load_run(str(a.run_dir)), load_run(str(b.run_dir))), console)
    return 0
