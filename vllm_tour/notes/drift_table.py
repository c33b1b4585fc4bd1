"""`annotations check --all-pins`: every note's anchored code on every release here, against the first release.

A cell says what became of the code a note points at (its qualified name, and its anchor inside it) on that
release, compared with the base release (the first column, the newest: the one notes are written against):
- same: it resolves, same code (whitespace ignored), same file and lines;
- moved: same code, at other lines or in another file (a note stays true; its line numbers change);
- changed: it resolves, the code differs (read it before showing the note there);
- gone: the qualified name or the anchor does not resolve.
A note whose anchor is absent on the base release itself is "gone" there and "-" (not compared) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_tour.notes.check import PinReport
from vllm_tour.notes.locate import Placement
from vllm_tour.notes.resolve import SourceTree, normalize

STATES = ("same", "moved", "changed", "gone")


@dataclass
class DriftTable:
    pins: list[str]  # base first
    cells: dict[str, dict[str, str]]  # note id -> pin -> state ("base" on the base pin when it resolves)

    def counts(self, pin: str) -> dict[str, int]:
        col = [row[pin] for row in self.cells.values()]
        return {s: col.count(s) for s in ("base", *STATES, "-") if s in col}

    def differing(self) -> dict[str, dict[str, str]]:
        """The notes whose code is not "same" on every release."""
        return {nid: row for nid, row in self.cells.items() if any(v not in ("same", "base", "-") for v in row.values())
                or row[self.pins[0]] == "gone"}


def _where(p: Placement, tree: SourceTree) -> tuple[str, int, int]:
    return str(p.symbol.path.relative_to(tree.root)), p.span.start, p.span.end


def state(base: Placement, base_tree: SourceTree, other: Placement, other_tree: SourceTree) -> str:
    if not base.ok:
        return "-"
    if not other.ok:
        return "gone"
    if normalize(base.text) != normalize(other.text):
        return "changed"
    return "same" if _where(base, base_tree) == _where(other, other_tree) else "moved"


def drift_table(reports: list[PinReport], trees: dict[str, SourceTree]) -> DriftTable:
    """`reports` from notes.check.check (every note placed on each pin), the base pin first."""
    base = reports[0]
    cells: dict[str, dict[str, str]] = {}
    for i, a in enumerate(base.placements):
        row = {base.pin: "base" if a.ok else "gone"}
        for r in reports[1:]:
            row[r.pin] = state(a, trees[base.pin], r.placements[i], trees[r.pin])
        cells[a.note.id] = row
    return DriftTable([r.pin for r in reports], cells)
