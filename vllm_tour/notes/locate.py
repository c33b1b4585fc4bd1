"""Where one note lands on one source tree: resolved (with its lines) or orphaned."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from vllm_tour.notes.annotations import Note
from vllm_tour.notes.resolve import NotFound, SourceTree, Span, Symbol, normalize


@dataclass
class Placement:
    note: Note
    symbol: Symbol | None  # None: the symbol itself is gone
    span: Span | None  # the anchored lines (the whole symbol when the note has no anchor)
    text: str = ""  # the anchored code, for drift
    problem: str = ""  # why it is an orphan
    suggestions: list[str] = field(default_factory=list)
    matches: int = 0  # statements containing the anchor (more than one: `occurrence` picks)

    @property
    def ok(self) -> bool:
        return self.span is not None


def locate(note: Note, tree: SourceTree, symbol: Symbol | None = None) -> Placement:
    if symbol is None:
        try:
            symbol = tree.resolve(note.symbol)
        except NotFound as e:
            return Placement(note, None, None, problem=e.why, suggestions=e.suggestions)
    if note.anchor is None:
        return Placement(note, symbol, symbol.span, symbol.code, matches=1)
    hits = tree.find(symbol, note.anchor)
    if len(hits) < note.nth:
        return Placement(
            note, symbol, None,
            problem=f"anchor `{note.anchor}` (occurrence {note.nth}) not in {note.symbol} "
            f"({len(hits)} match{'es' if len(hits) != 1 else ''})",
            suggestions=_nearest_statement(note.anchor, symbol), matches=len(hits),
        )
    st = hits[note.nth - 1]
    return Placement(note, symbol, st.span, st.text, matches=len(hits))


def _nearest_statement(anchor: str, symbol: Symbol) -> list[str]:
    """The statement of the symbol most like the lost anchor (first line of it)."""
    want = normalize(anchor)
    scored = []
    for st in symbol.statements:
        got = normalize(st.text)
        # The anchor is a fragment of a statement: align on the longest common
        # run, then compare the anchor with the same-sized window around it.
        m = difflib.SequenceMatcher(None, want, got, autojunk=False).find_longest_match(0, len(want), 0, len(got))
        lo = max(0, m.b - m.a)
        r = difflib.SequenceMatcher(None, want, got[lo : lo + len(want) + 2], autojunk=False).ratio()
        scored.append((r, st))
    scored.sort(key=lambda x: -x[0])
    out = []
    for r, st in scored[:1]:
        if r >= 0.5:
            out.append(f"line {st.span.start}: {st.text.strip().splitlines()[0]}")
    return out
