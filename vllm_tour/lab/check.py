"""`vllm-tour lab check DIR`: compare the lab's file, swapped into the reference engine, with upstream."""

from __future__ import annotations

import ast
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vllm_tour.errors import TourError
from vllm_tour.lab.labdir import LabDir, read_lab

MAX_NAMED = 4  # unwritten bodies named in the error line; the rest are counted
VALUE_CHARS = 120  # of each side's value in the summary line (the report above shows them whole)


def unwritten(file: Path) -> list[str]:
    """Qualified names of the functions in `file` whose whole body is still `raise NotImplementedError(...)`."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except SyntaxError as e:
        raise TourError(f"{file}: syntax error at line {e.lineno}: {e.msg}") from None
    found: list[str] = []

    def walk(nodes: list[ast.stmt], prefix: str) -> None:
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _only_raises_not_implemented(node):
                found.append(prefix + node.name)

    walk(tree.body, "")
    return found


def _only_raises_not_implemented(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def check_lab(directory: Path, console: Console, fresh: bool = False) -> int:
    """0: every scenario clean; 1: some diverged; TourError (exit 2): could not run."""
    lab = read_lab(directory)
    todo = unwritten(lab.file)
    if todo:
        named = ", ".join(todo[:MAX_NAMED]) + (f" and {len(todo) - MAX_NAMED} more" if len(todo) > MAX_NAMED else "")
        raise TourError(f"lab {lab.component}: {len(todo)} bodies in {lab.file} still raise NotImplementedError "
                        f"(not written yet: {named}); write them, then run `vllm-tour lab check {lab.path}` again")
    from vllm_tour.compare import harness, report
    from vllm_tour.compare.reimpl_side import engine_components

    engine_components(lab.module, lab.impl)  # the file's interface, before any engine starts
    results = []
    for scenario in lab.scenarios:
        console.print(f"[dim]lab {lab.component} · {scenario.stem}: upstream ({'afresh' if fresh else 'cached per scenario'}) vs "
                      f"{escape(lab.module)} with your {escape(lab.lab.entry)}…[/]")
        result = harness.compare(lab.module, scenario, impl=lab.impl, explain=True, fresh=fresh)
        report.render(result, console, explain=True)
        results.append(result)
    for line in summary(lab, results):
        console.print(line)
    return 0 if all(r.clean for r in results) else 1


def summary(lab: LabDir, results: list) -> list[str]:
    """One line per scenario: clean, or where it first diverged (step and field, or tensor and step)."""
    lines = []
    for r in results:
        head = f"lab {lab.component} · {r.scenario}:"
        where = first_difference(r)
        lines.append(f"{head} [green]clean[/]" if where is None else f"{head} [red]DIVERGED[/] {escape(where)}")
    return lines


def first_difference(result) -> str | None:
    """The earliest difference: a decision or a tensor out of tolerance, whichever comes first in the
    engine's order (within a step: decisions, then the model's tensors, then the tokens sampled from
    them), else the tokens."""
    if result.clean:
        return None
    first = result.first  # in data-flow order (compare/flow.py): the cause before its symptoms
    bad = next((t for t in result.bad_tensors if t.name == first.field and t.step == first.step), None)
    if bad is not None:
        return f"at step {bad.step}, tensor {bad.name}: max |Δ| {bad.max_abs:.3g} > tolerance (atol {bad.atol:g})"
    if first.step is not None:
        return f"at step {first.step}, field {first.field}: upstream {_short(first.upstream)}, yours {_short(first.reimpl)}"
    return f"in {first.field}: upstream {_short(first.upstream)}, yours {_short(first.reimpl)}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 1] + "…"
