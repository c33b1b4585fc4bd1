"""`vllm-tour annotations check`: do the notes still hold on each pin?

Per pin, each note is what its `pins` / `variant` / `not_on` say it is there (annotations.Note.status_on):
- claimed (checked against the pin, own text or a variant): it must resolve, else it is orphaned
  (orphans name the nearest candidate);
- unchecked (the pin is in none of those lists) but its code resolves: it would be shown on a pin nobody
  checked it against, a problem like an orphan;
- unchecked and not resolving, or marked not_on: not shown there, fine.
Between the first pin and each other one: drifted notes — resolved on both, but the anchored code differs
once whitespace is ignored; a drift is reviewed when the note is claimed on the other pin (someone read
that code), else it is one more reason to check the note there.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from vllm_tour.notes import checked as checked_code
from vllm_tour.notes.annotations import Note
from vllm_tour.notes.locate import Placement, locate
from vllm_tour.notes.resolve import NotFound, SourceTree, Symbol, normalize


@dataclass
class PinReport:
    pin: str
    placements: list[Placement]  # every note's, claimed here or not
    # claimed and resolved notes against checked.json: note id -> the pieces changed since accepted
    stale: dict[str, list[str]] = field(default_factory=dict)
    unrecorded: list[str] = field(default_factory=list)  # never accepted on this pin
    missing_depends: dict[str, list[str]] = field(default_factory=dict)  # `depends` names not found here
    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # note id -> its code's digests now

    def _claimed(self, p: Placement) -> bool:
        return p.note.status_on(self.pin) in ("applies", "variant")

    @property
    def resolved(self) -> list[Placement]:
        return [p for p in self.placements if p.ok and self._claimed(p)]

    @property
    def orphaned(self) -> list[Placement]:
        return [p for p in self.placements if not p.ok and self._claimed(p)]

    @property
    def unchecked(self) -> list[Placement]:
        """Shown on this pin (the code resolves) but never checked against it."""
        return [p for p in self.placements if p.ok and p.note.status_on(self.pin) == "unchecked"]

    @property
    def not_shown(self) -> list[Placement]:
        """Marked not_on this pin, or unchecked and absent from its code."""
        return [p for p in self.placements if not self._claimed(p) and not (p.ok and p.note.status_on(self.pin) == "unchecked")]

    @property
    def ambiguous(self) -> list[Placement]:
        """Anchors matching several statements with no `occurrence` chosen."""
        return [p for p in self.placements if p.ok and p.matches > 1 and p.note.occurrence is None]


@dataclass
class Drift:
    note: Note
    base: str
    other: str
    base_lines: str  # "path:start-end" on each pin
    other_lines: str
    base_text: str = ""
    other_text: str = ""

    def diff(self) -> str:
        """The anchored code, base pin -> other pin, as a unified diff."""
        return "".join(difflib.unified_diff(self.base_text.splitlines(keepends=True), self.other_text.splitlines(keepends=True),
                                            f"{self.base} {self.base_lines}", f"{self.other} {self.other_lines}"))


@dataclass
class CheckReport:
    pins: list[PinReport]
    drift: dict[str, list[Drift]] = field(default_factory=dict)  # other pin -> drifted notes

    @property
    def orphan_count(self) -> int:
        return sum(len(r.orphaned) for r in self.pins)

    @property
    def problem_count(self) -> int:
        """Orphaned notes, notes shown on a pin they were not checked against, notes whose code changed since
        they were accepted (or never were), and `depends` names that do not resolve."""
        return sum(len(r.orphaned) + len(r.unchecked) + len(r.stale) + len(r.unrecorded) + len(r.missing_depends)
                   for r in self.pins)

    def to_json(self) -> dict:
        return {
            "pins": [
                {
                    "pin": r.pin,
                    "resolved": len(r.resolved),
                    "orphaned": len(r.orphaned),
                    "unchecked": [p.note.id for p in r.unchecked],
                    "not_shown": len(r.not_shown),
                    "stale": r.stale,
                    "unrecorded": r.unrecorded,
                    "missing_depends": r.missing_depends,
                    "drifted": len(self.drift.get(r.pin, [])),
                    "orphans": [
                        {"id": p.note.id, "symbol": p.note.symbol, "anchor": p.note.anchor,
                         "problem": p.problem, "nearest": p.suggestions}
                        for p in r.orphaned
                    ],
                    "drift": [{"id": d.note.id, "symbol": d.note.symbol, "anchor": d.note.anchor,
                               "base": d.base_lines, "here": d.other_lines,
                               "reviewed": d.note.status_on(r.pin) in ("applies", "variant")}
                              for d in self.drift.get(r.pin, [])],
                }
                for r in self.pins
            ]
        }


def check_pin(pin: str, tree: SourceTree, notes: list[Note]) -> PinReport:
    symbols: dict[str, Symbol | NotFound] = {}
    out = []
    for n in notes:
        if n.symbol not in symbols:
            try:
                symbols[n.symbol] = tree.resolve(n.symbol)
            except NotFound as e:
                symbols[n.symbol] = e
        s = symbols[n.symbol]
        if isinstance(s, NotFound):
            out.append(Placement(n, None, None, problem=s.why, suggestions=s.suggestions))
        else:
            out.append(locate(n, tree, s))
    return PinReport(pin, out)


def _where(p: Placement, tree: SourceTree) -> str:
    return f"{p.symbol.path.relative_to(tree.root.parent)}:{p.span.start}-{p.span.end}"


def drift(base: PinReport, base_tree: SourceTree, other: PinReport, other_tree: SourceTree) -> list[Drift]:
    out = []
    for a, b in zip(base.placements, other.placements):
        if a.ok and b.ok and normalize(a.text) != normalize(b.text):
            out.append(Drift(a.note, base.pin, other.pin, _where(a, base_tree), _where(b, other_tree), a.text, b.text))
    return out


def against_checked(r: PinReport, tree: SourceTree, stored: dict) -> None:
    """Fill r.digests and, for every note claimed and resolved on the pin, what changed since it was accepted."""
    for p in r.resolved:
        now, missing = checked_code.current(p.note, p, tree)
        r.digests[p.note.id] = now
        if missing:
            r.missing_depends[p.note.id] = missing
        was = stored.get(p.note.id, {}).get(r.pin)
        if was is None:
            r.unrecorded.append(p.note.id)
        elif changes := checked_code.changed(was, now):
            r.stale[p.note.id] = changes


def check(trees: dict[str, SourceTree], notes: list[Note], stored: dict | None = None) -> CheckReport:
    reports = [check_pin(pin, tree, notes) for pin, tree in trees.items()]
    for r in reports:
        against_checked(r, trees[r.pin], checked_code.load_checked() if stored is None else stored)
    rep = CheckReport(reports)
    base = reports[0]
    for r in reports[1:]:
        rep.drift[r.pin] = drift(base, trees[base.pin], r, trees[r.pin])
    return rep
