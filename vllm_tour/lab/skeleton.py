"""Generate a lab's skeleton from its reference file: same signatures, bodies to write.

The reference source is rewritten with libcst, never copied by hand, so a skeleton
always has the reference's current interface:
- the stubbed classes' methods and stubbed functions keep their signatures and type
  hints; their bodies become a docstring (the reference's, plus what upstream does and
  which notes to read) and `raise NotImplementedError(...)`;
- everything else (dataclasses, constants, helper functions) is kept as it is;
- relative imports point at the reference package (`from .request import` ->
  `from reimpl.request import`), so the lab file runs from any directory.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import libcst as cst

from vllm_tour.compare.components import COMPONENTS
from vllm_tour.errors import TourError
from vllm_tour.lab.catalog import Lab
from vllm_tour.notes.annotations import Note, all_notes, load_all
from vllm_tour.paths import REPO_ROOT

UNFILLED = "not written yet"  # in every stub's NotImplementedError message (check.py looks for stubs)
NOTE_HINT_CHARS = 220


def skeleton_source(lab: Lab) -> str:
    """The lab file's text. TourError if the catalog and the reference disagree."""
    path = REPO_ROOT / lab.reference
    module = cst.parse_module(path.read_text(encoding="utf-8"))
    notes = {n.id: n for n in all_notes(load_all())}
    package = lab.reference.rsplit("/", 1)[0].replace("/", ".")
    body, seen = _rewrite(module, lab, notes, package)
    missing = (set(lab.stub) | set(lab.from_reference)) - seen
    if missing:
        raise TourError(f"{lab.reference} defines no {', '.join(sorted(missing))} (lab catalog out of date)")
    if lab.from_reference:
        names = ", ".join(lab.from_reference)
        last_import = max(i for i, s in enumerate(body) if _is_import(s))
        module_name = f"{package}.{Path(lab.reference).stem}"
        imp = cst.parse_statement(f"from {module_name} import {names}  # the engine's own: use as is\n")
        body.insert(last_import + 1, imp.with_changes(leading_lines=[cst.EmptyLine()]))
    body.insert(0, _docstring(_intro(lab, module.get_docstring(clean=True)), ""))
    return module.with_changes(body=body).code


def _rewrite(module: cst.Module, lab: Lab, notes: dict[str, Note], package: str) -> tuple[list, set[str]]:
    """The new top-level statements, and which catalog names were found."""
    seen: set[str] = set()
    body: list[cst.CSTNode] = []
    for stmt in module.body[1:] if module.get_docstring() is not None else module.body:
        name = stmt.name.value if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)) else None
        if name in lab.from_reference or name in lab.drop:
            seen.add(name)
        elif name in lab.stub:
            seen.add(name)
            body.append(_stub_class(stmt, lab, notes) if isinstance(stmt, cst.ClassDef)
                        else _stub_function(stmt, name, lab, notes, ""))
        elif isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.ImportFrom):
            imp = _import(stmt, lab, package)
            if imp is not None:
                body.append(imp)
        else:
            body.append(stmt)
    return body, seen


def _import(stmt: cst.SimpleStatementLine, lab: Lab, package: str) -> cst.SimpleStatementLine | None:
    """A relative import made absolute, without the names the lab drops (None: nothing left)."""
    imp = stmt.body[0]
    if imp.relative:
        dotted = package + ("." + _dotted(imp.module) if imp.module else "")
        imp = imp.with_changes(relative=(), module=cst.parse_expression(dotted))
    if isinstance(imp.names, cst.ImportStar):
        return stmt.with_changes(body=[imp])
    kept = [a for a in imp.names if _dotted(a.name) not in lab.drop]
    if not kept:
        return None
    if len(kept) != len(imp.names):
        kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        # the line's comment ("noqa: re-exported") was about the dropped names
        stmt = stmt.with_changes(trailing_whitespace=cst.TrailingWhitespace(newline=cst.Newline()))
    return stmt.with_changes(body=[imp.with_changes(names=kept)])


def _stub_class(cls: cst.ClassDef, lab: Lab, notes: dict[str, Note]) -> cst.ClassDef:
    name = cls.name.value
    body = list(cls.body.body)
    if cls.get_docstring() is not None:
        body = body[1:]
    body = [_stub_function(s, f"{name}.{s.name.value}", lab, notes, "    ") if isinstance(s, cst.FunctionDef) else s
            for s in body]
    doc = _join(cls.get_docstring(clean=True), _reads(lab, name, notes))
    if doc:
        if body and not body[0].leading_lines:
            body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine()])
        body.insert(0, _docstring(doc, "    "))
    return cls.with_changes(body=cls.body.with_changes(body=body))


def _stub_function(fn: cst.FunctionDef, qualname: str, lab: Lab, notes: dict[str, Note],
                   indent: str) -> cst.FunctionDef:
    doc = _join(fn.get_docstring(clean=True), _reads(lab, qualname, notes))
    if not doc:
        raise TourError(f"lab {lab.component}: {qualname} has no docstring, note or hint (lab catalog)")
    raise_ = cst.parse_statement(f'raise NotImplementedError("{qualname}: {UNFILLED}")\n')
    return fn.with_changes(body=cst.IndentedBlock([_docstring(doc, indent + "    "), raise_]))


def _intro(lab: Lab, reference_doc: str | None) -> str:
    intro = (f"Lab {lab.component}: write your own `{lab.entry}`, then diff it against upstream vLLM with\n"
             f"`vllm-tour lab check DIR` (DIR: the folder holding this file; its README.md says more).\n\n"
             f"Generated by `vllm-tour lab new {lab.component}` from the reference {lab.reference}: the same\n"
             f"names and signatures, which the reference engine calls. Every body that raises\n"
             f"NotImplementedError (\"{UNFILLED}\") is yours to write; its docstring says what upstream\n"
             f"does and which annotated notes to read. Add helpers as you like; keep the names.")
    what = textwrap.fill(f"What upstream's counterpart does: {COMPONENTS[lab.component].doc}", 96,
                         break_on_hyphens=False)
    return _join(intro, what, f"The reference's introduction:\n\n{reference_doc}" if reference_doc else None)


def _reads(lab: Lab, qualname: str, notes: dict[str, Note]) -> str:
    """What upstream does and what to read, for one stubbed class/method docstring."""
    lines: list[str] = []
    by_symbol: dict[str, list[Note]] = {}
    for ref in lab.reads.get(qualname, ()):
        if ref.startswith("vllm."):
            by_symbol.setdefault(ref, [])
        elif ref in notes:
            by_symbol.setdefault(notes[ref].symbol, []).append(notes[ref])
        else:
            raise TourError(f"lab {lab.component}: {qualname} cites note {ref!r}, "
                            "which no annotations/*.toml defines")
    for symbol, symbol_notes in by_symbol.items():
        lines.append(f"Upstream: `{symbol}`.")
        for n in symbol_notes:
            lines += textwrap.wrap(f"Note {n.id}: {_first_sentences(n.en)}", 92, subsequent_indent="    ")
        if symbol_notes:
            these = "this note" if len(symbol_notes) == 1 else "these notes"
            lines.append(f"    (`vllm-tour source {symbol}` shows the code with {these} in place.)")
    hint = lab.hints.get(qualname)
    if hint:
        lines += textwrap.wrap(hint, 96)
    return "\n".join(lines)


def _first_sentences(markdown: str) -> str:
    text = " ".join(markdown.split())
    cut = re.search(r"(?<=\.)\s", text[60:])  # the first sentence, or two if the first is short
    text = text[: 60 + cut.start()] if cut else text
    return text if len(text) <= NOTE_HINT_CHARS else text[: NOTE_HINT_CHARS - 1] + "…"


def _docstring(text: str, indent: str) -> cst.SimpleStatementLine:
    text = text.strip().replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    body = text.replace("\n", "\n" + indent) if "\n" in text else text
    closing = f"\n{indent}" if "\n" in text else ""
    body = "\n".join(line.rstrip() for line in body.split("\n"))
    return cst.SimpleStatementLine([cst.Expr(cst.SimpleString(f'"""{body}{closing}"""'))])


def _join(*parts: str | None) -> str:
    return "\n\n".join(p.strip() for p in parts if p and p.strip())


def _dotted(expr: cst.BaseExpression) -> str:
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return f"{_dotted(expr.value)}.{expr.attr.value}"
    raise TypeError(f"not a dotted name: {expr!r}")


def _is_import(stmt: cst.CSTNode) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine)
            and any(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body))
