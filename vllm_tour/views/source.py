"""`vllm-tour source`: a symbol's pinned source with its notes in place (rich).

Code is highlighted once as a whole (so a docstring split by a note keeps its
colours), then printed line by line; each note follows the last line it
anchors, and the anchored lines carry a marker in the gutter with the note's
number. Notes on the whole symbol come first.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.markdown import Markdown
from rich.padding import Padding
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from vllm_tour.notes.annotations import Note, caution_text
from vllm_tour.notes.glossary import FirstUse
from vllm_tour.notes.locate import Placement, locate
from vllm_tour.notes.resolve import SourceTree, Symbol

_LABEL = {
    "en": {"note": "note", "orphan": "orphaned note", "probes": "probes", "concepts": "concepts", "see": "see",
           "notes": lambda n: f"{n} note{'s' if n != 1 else ''}"},
    "zh": {"note": "注解", "orphan": "失效注解", "probes": "探针", "concepts": "概念", "see": "参见",
           "notes": lambda n: f"{n} 条注解"},
}


def placements(notes: list[Note], tree: SourceTree, symbol: Symbol) -> list[Placement]:
    return [locate(n, tree, symbol) for n in notes]


def _note_panel(i: int, p: Placement, lang: str, pin: str, gloss: FirstUse) -> Panel:
    label = _LABEL[lang]
    text = p.note.text(lang)
    body = [Markdown(gloss(text) if lang == "zh" else text)]
    tags = []
    if p.note.probes:
        tags.append(f"{label['probes']}: " + ", ".join(p.note.probes))
    if p.note.concepts:
        tags.append(f"{label['concepts']}: " + ", ".join(p.note.concepts))
    if p.note.see:
        tags.append(f"{label['see']}: " + ", ".join(p.note.see))
    if tags:
        body.append(Text("  ·  ".join(tags), style="dim"))
    if p.note.caution:
        body.insert(0, Text("⚠ " + caution_text(p.note, lang, pin), style="yellow"))
    if not p.ok:
        body.insert(0, Text(f"{label['orphan']}: {p.problem}", style="bold red"))
    title = f"[{i}] {label['note']} · {p.note.id}"
    return Panel(Group(*body), title=title, title_align="left", border_style="yellow" if p.ok else "red")


def render(console: Console, tree: SourceTree, symbol: Symbol, notes: list[Note], lang: str, pin: str) -> None:
    places = placements(notes, tree, symbol)
    rel = symbol.path.relative_to(tree.root.parent)
    console.print(Text.assemble((symbol.qualname, "bold"), f"  {rel}:{symbol.span.start}-{symbol.span.end}  ",
                                (f"pin {pin} · {_LABEL[lang]['notes'](len(notes))} · {lang}", "dim")))
    numbered = list(enumerate(places, 1))
    top = [(i, p) for i, p in numbered if p.note.anchor is None or not p.ok]
    inline = [(i, p) for i, p in numbered if p.note.anchor is not None and p.ok]
    gloss = FirstUse()  # a glossary term's first use on this page gets its English
    for i, p in top:
        console.print(_note_panel(i, p, lang, pin, gloss))

    code = symbol.code
    syntax = Syntax(code, "python", theme="monokai", background_color="default")
    lines = syntax.highlight(code).split("\n", allow_blank=True)
    after: dict[int, list[tuple[int, Placement]]] = {}
    for i, p in inline:
        after.setdefault(p.span.end, []).append((i, p))
    width = len(str(symbol.span.end))
    for k, line in enumerate(lines[: symbol.span.end - symbol.span.start + 1]):
        ln = symbol.span.start + k
        marks = [str(i) for i, p in inline if ln in p.span]
        gutter = Text(f"{ln:>{width}} ", style="dim")
        gutter.append("▌" if marks else "│", style="bold yellow" if marks else "dim")
        gutter.append(" ")
        # A line longer than the terminal folds under itself, right of the gutter: code is never cut.
        row = Table.grid()
        row.add_column(width=width + 3, no_wrap=True)
        row.add_column(overflow="fold")
        row.add_row(gutter, line)
        console.print(row)
        for i, p in after.get(ln, []):
            console.print(Padding(_note_panel(i, p, lang, pin, gloss), (0, 0, 0, width + 3)))
