"""Qualified names → code, with libcst, never by line number.

A qualified name is `vllm.<module path>.<Class>.<method>` (or a module alone).
The longest prefix that names a module file picks the file; the rest walks
class/def scopes inside it. A finer anchor is a piece of code text: the first
statement inside the symbol whose text contains it (whitespace ignored, so a
reformatted call still matches). Spans are computed fresh from the current
file, so inserted lines or a renamed neighbour never move a note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from vllm_tour.errors import TourError

# Blocks whose bodies still belong to the enclosing scope (a def under
# `if TYPE_CHECKING:` is still a member of the module/class).
_TRANSPARENT = (cst.If, cst.Else, cst.Try, cst.TryStar, cst.ExceptHandler, cst.ExceptStarHandler,
                cst.Finally, cst.With, cst.For, cst.While)
_COMPOUND = (cst.If, cst.Else, cst.For, cst.While, cst.With, cst.Try, cst.TryStar, cst.ExceptHandler,
             cst.ExceptStarHandler, cst.Finally, cst.FunctionDef, cst.ClassDef, cst.Match)


class NotFound(TourError):
    """A qualified name that does not resolve on this tree (message names close names)."""

    def __init__(self, message: str, why: str = "", suggestions: list[str] | None = None):
        super().__init__(message)
        self.why = why
        self.suggestions = suggestions or []


@dataclass(frozen=True)
class Span:
    start: int  # 1-based, inclusive
    end: int

    def __contains__(self, line: int) -> bool:
        return self.start <= line <= self.end


@dataclass
class Statement:
    span: Span  # the lines the anchor points at (a compound statement's header only)
    text: str  # those lines' code


@dataclass
class Symbol:
    qualname: str
    path: Path
    span: Span  # decorators included
    lines: list[str]  # the whole file, for rendering with context
    statements: list[Statement] = field(repr=False, default_factory=list)

    @property
    def code(self) -> str:
        return "".join(self.lines[self.span.start - 1 : self.span.end])


def normalize(code: str) -> str:
    """Code text compared without whitespace: reformatting is not a change."""
    return re.sub(r"\s+", "", code)


@dataclass
class _Parsed:
    module: cst.Module
    pos: dict
    lines: list[str]


class SourceTree:
    """The `vllm` package sources of one pin (a directory named `vllm`)."""

    def __init__(self, root: Path, label: str = ""):
        self.root = Path(root)
        self.label = label or str(root)
        self._parsed: dict[Path, _Parsed] = {}
        self._names: list[str] | None = None
        # A tree is read-only for its lifetime (edit a copy, then make a new
        # SourceTree), so lookups and suggestions are memoized.
        self._symbols: dict[str, Symbol | NotFound] = {}
        self._suggested: dict[str, list[str]] = {}

    # -- modules ------------------------------------------------------------
    def module_file(self, dotted: list[str]) -> Path | None:
        if not dotted or dotted[0] != self.root.name:
            return None
        base = self.root.joinpath(*dotted[1:])
        for cand in (base.with_suffix(".py") if len(dotted) > 1 else None, base / "__init__.py"):
            if cand is not None and cand.is_file():
                return cand
        return None

    def _parse(self, path: Path) -> _Parsed:
        if path not in self._parsed:
            text = path.read_text(encoding="utf-8")
            wrapper = MetadataWrapper(cst.parse_module(text))
            pos = wrapper.resolve(PositionProvider)
            self._parsed[path] = _Parsed(wrapper.module, pos, text.splitlines(keepends=True))
        return self._parsed[path]

    # -- symbols ------------------------------------------------------------
    def resolve(self, qualname: str) -> Symbol:
        if qualname not in self._symbols:
            try:
                self._symbols[qualname] = self._resolve(qualname)
            except NotFound as e:
                self._symbols[qualname] = e
        found = self._symbols[qualname]
        if isinstance(found, NotFound):
            raise found
        return found

    def _resolve(self, qualname: str) -> Symbol:
        parts = qualname.split(".")
        for i in range(len(parts), 0, -1):
            path = self.module_file(parts[:i])
            if path is not None:
                break
        else:
            raise self._unknown(qualname, "no such module")
        p = self._parse(path)
        node: cst.CSTNode = p.module
        for j in range(i, len(parts)):
            found = _member(node, parts[j])
            if found is None:
                raise self._unknown(qualname, f"'{parts[j]}' not found in {'.'.join(parts[:j])}")
            node = found
        if isinstance(node, cst.Module):
            span = Span(1, max(1, len(p.lines)))
        else:
            start = p.pos[node].start.line
            for d in getattr(node, "decorators", ()):
                start = min(start, p.pos[d].start.line)
            span = Span(start, p.pos[node].end.line)
        return Symbol(qualname, path, span, p.lines, _statements(node, p))

    def _unknown(self, qualname: str, why: str) -> NotFound:
        close = self.suggest(qualname)
        hint = f"; did you mean: {', '.join(close)}" if close else ""
        return NotFound(f"unknown symbol {qualname} on {self.label} ({why}){hint}", why, close)

    def find(self, sym: Symbol, anchor: str) -> list[Statement]:
        """Statements of `sym` whose code contains `anchor`, in source order; [] when none."""
        want = normalize(anchor)
        return [s for s in sym.statements if want in normalize(s.text)]

    # -- suggestions --------------------------------------------------------
    def all_names(self) -> list[str]:
        if self._names is None:
            from vllm_tour.notes.index import qualnames

            self._names = qualnames(self.root)
        return self._names

    def suggest(self, qualname: str, n: int = 3) -> list[str]:
        from vllm_tour.notes.index import nearest

        key = f"{qualname}/{n}"
        if key not in self._suggested:
            self._suggested[key] = nearest(qualname, self.all_names(), n)
        return self._suggested[key]


def _body(node: cst.CSTNode) -> list[cst.CSTNode]:
    if isinstance(node, cst.Module):
        return list(node.body)
    body = getattr(node, "body", None)
    if isinstance(body, (cst.IndentedBlock, cst.SimpleStatementSuite)):
        out = list(body.body)
    else:
        out = []
    # else/except/finally hang off the statement, not its body
    for attr in ("orelse", "handlers", "finalbody"):
        extra = getattr(node, attr, None)
        if isinstance(extra, (list, tuple)):
            out.extend(extra)
        elif extra is not None:
            out.append(extra)
    return out


def _member(scope: cst.CSTNode, name: str) -> cst.CSTNode | None:
    """The def/class `name` bound in `scope`; the last one wins, as in Python
    (so an `@overload` stub never shadows the implementation)."""
    found = None
    stack = list(_body(scope))
    while stack:
        n = stack.pop(0)
        if isinstance(n, (cst.FunctionDef, cst.ClassDef)):
            if n.name.value == name:
                found = n
        elif isinstance(n, _TRANSPARENT):
            stack[0:0] = _body(n)
    return found


class _Collect(cst.CSTVisitor):
    def __init__(self, p: _Parsed):
        self.p = p
        self.out: list[Statement] = []

    def _add(self, start: int, end: int) -> None:
        self.out.append(Statement(Span(start, end), "".join(self.p.lines[start - 1 : end])))

    def visit_SimpleStatementLine(self, node) -> None:
        r = self.p.pos[node]
        self._add(r.start.line, r.end.line)

    def on_visit(self, node) -> bool:
        if isinstance(node, _COMPOUND):
            r = self.p.pos[node]
            body = getattr(node, "body", None)
            first = None
            if isinstance(body, cst.IndentedBlock) and body.body:
                first = self.p.pos[body.body[0]].start.line
                # comments above the first body statement are not the header
                first -= len(body.body[0].leading_lines) if hasattr(body.body[0], "leading_lines") else 0
            end = max(r.start.line, (first - 1) if first else r.start.line)
            self._add(r.start.line, end)
        return super().on_visit(node)


def _statements(node: cst.CSTNode, p: _Parsed) -> list[Statement]:
    c = _Collect(p)
    node.visit(c)
    c.out.sort(key=lambda s: (s.span.start, s.span.end))
    return c.out
