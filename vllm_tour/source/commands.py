"""What `source`, `annotations check` and `site` do; cli.py only parses and calls these."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import pins
from ..errors import TourError
from .annotations import LANGS, all_notes, load_all, notes_for
from .check import check
from .pinned import tree_for_pin


def _status(msg: str) -> None:
    # on stderr: stdout stays the report (and valid JSON with --json)
    print(msg, file=sys.stderr, flush=True)


def show_source(console: Console, qualname: str, lang: str, pin: str | None) -> None:
    from .render import render

    if lang not in LANGS:
        raise TourError(f"unknown language '{lang}' (use one of: {', '.join(LANGS)})")
    tag = pin or pins.active_pin_tag()
    tree = tree_for_pin(tag, _status)
    symbol = tree.resolve(qualname)  # NotFound is a TourError: one line with close names
    render(console, tree, symbol, notes_for(load_all(), qualname), lang, tag)


def run_check(console: Console, pin_tags: list[str], as_json: bool) -> int:
    """Exit code: 0 all notes resolve on every pin, 1 some are orphaned."""
    tags = list(dict.fromkeys(pin_tags or [pins.active_pin_tag()]))
    notes = all_notes(load_all())
    trees = {t: tree_for_pin(t, _status) for t in tags}
    rep = check(trees, notes)
    if as_json:
        print(json.dumps(rep.to_json(), indent=2, ensure_ascii=False))
        return 1 if rep.orphan_count else 0

    table = Table(title=f"annotations check — {len(notes)} notes")
    for col in ("pin", "resolved", "orphaned", "drifted", "ambiguous"):
        table.add_column(col, justify="right" if col != "pin" else "left")
    for r in rep.pins:
        d = rep.drift.get(r.pin)
        table.add_row(r.pin, str(len(r.resolved)), f"[red]{len(r.orphaned)}[/]" if r.orphaned else "0",
                      "—" if d is None else str(len(d)), str(len(r.ambiguous)))
    console.print(table)
    if len(tags) > 1:
        console.print(f"[dim]drifted: resolves on both pins but the anchored code differs from pin {tags[0]}[/]")
    for r in rep.pins:
        for p in r.orphaned:
            near = f" → nearest: {p.suggestions[0]}" if p.suggestions else " → no close candidate"
            anchor = f" @ `{p.note.anchor}`" if p.note.anchor else ""
            console.print(f"[red]orphan[/] {r.pin} {p.note.id}: {p.note.symbol}{anchor} — {p.problem}{near}",
                          soft_wrap=True)
        for p in r.ambiguous:
            console.print(f"[yellow]ambiguous[/] {r.pin} {p.note.id}: anchor matches {p.matches} statements; "
                          f"the first is used (set `occurrence` to choose)", soft_wrap=True)
    for other, drifts in rep.drift.items():
        for d in drifts:
            anchor = f" @ `{d.note.anchor}`" if d.note.anchor else " (whole symbol)"
            console.print(f"[yellow]drift[/] {d.base}→{other} {d.note.id}: {d.note.symbol}{anchor}  "
                          f"{d.base_lines} → {d.other_lines}", soft_wrap=True)
    return 1 if rep.orphan_count else 0


def build_site(console: Console, out: Path, pin: str | None) -> Path:
    from .html import write_site

    tag = pin or pins.active_pin_tag()
    tree = tree_for_pin(tag, _status)
    index = write_site(out, tree, load_all(), tag)
    console.print(f"site for pin {tag}: {index}")
    return index
