"""`vllm-tour annotations records`: one row per note saying what it was checked against and how it is proven.

annotations/records/notes.md is generated and checked in. Its mechanical columns come from the notes, the
locator and the proof files: the lines each note lands on, on every pin it claims (`pins`, `variant`), inside
which symbol; the proof on each release (check and scenario: annotations/proofs/, as `annotations verify`
holds each release to it). Its hand-written columns come from annotations/records/reasons.toml:

    [sched-waiting-gate]
    read = "whole"        # the anchored function (and the callers that gate it) read whole on each claimed pin;
                          # absent: the row has only the mechanical columns
    conditions = "..."    # the conditions upstream checks on that path, as read
    changed = "..."       # what that reading changed in the note (a condition added, a claim fixed)
    reason = "..."        # why there is no proof (required when the note has none on any release it is shown on)

A note with no proof and no reason, a reason on a proven note and an entry for no note are errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from vllm_tour.errors import TourError
from vllm_tour.notes.annotations import Note, all_notes, load_all, read_toml
from vllm_tour.notes.check import check_pin
from vllm_tour.notes.resolve import SourceTree
from vllm_tour.paths import ANNOTATIONS_DIR

RECORDS_DIR = ANNOTATIONS_DIR / "records"
REASONS = RECORDS_DIR / "reasons.toml"
RECORD = RECORDS_DIR / "notes.md"
CLAIM_PINS = ("v0.32.0", "v0.21.0")  # the pins notes are checked against (annotations check --pin ...)
PROOF_PINS = ("v0.32.0", "v0.31.0", "v0.21.0")  # the releases `annotations verify` holds to proofs


class Reason(BaseModel):
    model_config = ConfigDict(extra="forbid")

    read: str = ""  # "whole" or ""
    conditions: str = ""
    changed: str = ""
    reason: str = ""


@dataclass
class Row:
    note: Note
    lines: dict[str, str]  # pin -> "path:start-end (symbol start-end)", "not on", or the orphan's problem
    proofs: dict[str, str]  # release -> "check (scenario)"
    hand: Reason = field(default_factory=Reason)

    @property
    def proven(self) -> bool:
        return bool(self.proofs)


def load_reasons(path: Path = REASONS) -> dict[str, Reason]:
    data = read_toml(path)
    out = {}
    for note_id, entry in data.items():
        try:
            r = Reason.model_validate(entry)
        except ValidationError as e:
            err = e.errors()[0]
            raise TourError(f"{path.name} [{note_id}]: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        if r.read not in ("", "whole"):
            raise TourError(f"{path.name} [{note_id}]: read must be \"whole\" or absent, not {r.read!r}")
        out[note_id] = r
    return out


def _proofs() -> dict[str, dict[str, str]]:
    from vllm_tour.notes.verify import proofs_for_pin

    out: dict[str, dict[str, str]] = {}
    for pin in PROOF_PINS:
        for note_id, p in proofs_for_pin(pin).items():
            out.setdefault(note_id, {})[pin] = f"`{p.check}` ({p.scenario})"
    return out


def rows(trees: dict[str, SourceTree]) -> list[Row]:
    notes = all_notes(load_all())
    placed = {pin: {p.note.id: p for p in check_pin(pin, tree, notes).placements} for pin, tree in trees.items()}
    proofs = _proofs()
    hand = load_reasons()
    out = []
    for n in notes:
        lines = {}
        for pin, tree in trees.items():
            status = n.status_on(pin)
            if status == "not_applicable":
                lines[pin] = "not on"
            elif status in ("applies", "variant"):
                p = placed[pin][n.id]
                if not p.ok:
                    lines[pin] = f"orphaned: {p.problem}"
                    continue
                where = f"{p.symbol.path.relative_to(tree.root.parent)}:{p.span.start}-{p.span.end}"
                whole = p.symbol.span
                if (whole.start, whole.end) != (p.span.start, p.span.end):
                    where += f" (in {whole.start}-{whole.end})"
                lines[pin] = where + (" [own text]" if status == "variant" else "")
        shown = {pin for pin in PROOF_PINS if n.status_on(pin) != "not_applicable"}
        out.append(Row(n, lines, {k: v for k, v in proofs.get(n.id, {}).items() if k in shown}, hand.get(n.id, Reason())))
    return out


def problems(rs: list[Row]) -> list[str]:
    """One line per note with neither a proof nor a reason, a reason beside a proof, or an entry for no note."""
    out = []
    known = {r.note.id for r in rs}
    for r in rs:
        if not r.proven and not r.hand.reason.strip():
            out.append(f"{r.note.id}: no proof and no reason ({REASONS.name})")
        if r.proven and r.hand.reason.strip():
            out.append(f"{r.note.id}: proven, yet {REASONS.name} gives a reason why not")
        if any(v.startswith("orphaned") for v in r.lines.values()):
            out.append(f"{r.note.id}: orphaned on a pin it claims")
    out += [f"{i}: in {REASONS.name}, but no note has this id" for i in load_reasons() if i not in known]
    return out


def counts(rs: list[Row]) -> dict[str, int]:
    return {"notes": len(rs), "proven": sum(r.proven for r in rs),
            "reason": sum(not r.proven and bool(r.hand.reason.strip()) for r in rs),
            "read_whole": sum(r.hand.read == "whole" for r in rs),
            "read_partly": sum(r.hand.read != "whole" and bool(r.hand.conditions.strip()) for r in rs),
            "changed": sum(bool(r.hand.changed.strip()) for r in rs)}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _proof_cell(proofs: dict[str, str]) -> str:
    by: dict[str, list[str]] = {}
    for pin, what in proofs.items():
        by.setdefault(what, []).append(pin)
    return "; ".join(f"{', '.join(pins)}: {what}" for what, pins in by.items())


def render(rs: list[Row]) -> str:
    c = counts(rs)
    head = [
        "# Per-note record",
        "",
        "Generated by `vllm-tour annotations records --write` from annotations/*.toml, the locator, "
        "annotations/proofs/ and annotations/records/reasons.toml (the hand-written columns); "
        "tests/test_note_records.py fails when this file is stale or a note has neither a proof nor a reason.",
        "",
        f"{c['notes']} notes: {c['proven']} proven on a live run, {c['reason']} with a reason why not; "
        f"{c['read_whole']} read whole against upstream's function (conditions listed), the other "
        f"{c['notes'] - c['read_whole']} not ({c['read_partly']} of them with conditions read around the anchor only, "
        f"the rest with the mechanical columns only); {c['changed']} changed by that reading.",
        "",
        "Columns: **lines** — the anchored statement on each pin the note claims (`[own text]`: its variant), inside "
        "the symbol's lines; **proof** — `check` (scenario) per release `annotations verify` holds it to; "
        "**read** — whole: the function (and the callers that gate it) read whole on each claimed pin, the "
        "conditions it checks listed; **conditions / reason** — what upstream checks on that path, what the "
        "reading changed, or why the note has no proof.",
        "",
    ]
    body = []
    sub = None
    for r in rs:
        if r.note.subsystem != sub:
            sub = r.note.subsystem
            body += ["", f"## {sub}", "", "| note | symbol | lines | proof | read | conditions / reason |",
                     "|---|---|---|---|---|---|"]
        lines = "<br>".join(f"{pin}: `{where}`" for pin, where in r.lines.items())
        hand = []
        if r.hand.conditions:
            hand.append(f"**conditions:** {r.hand.conditions}")
        if r.hand.changed:
            hand.append(f"**changed:** {r.hand.changed}")
        if r.hand.reason:
            hand.append(f"**no proof:** {r.hand.reason}")
        body.append(f"| `{r.note.id}` | `{r.note.symbol}` | {lines} | {_cell(_proof_cell(r.proofs)) or '—'} | "
                    f"{r.hand.read or 'mechanical'} | {_cell(' '.join(hand)) or '—'} |")
    return "\n".join(head + body) + "\n"


def trees() -> dict[str, SourceTree]:
    from vllm_tour.notes.pinned import tree_for_pin

    return {pin: tree_for_pin(pin) for pin in CLAIM_PINS}
