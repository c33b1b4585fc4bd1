"""What each check requires its run to show, read from the check's own code.

A check states its requirement where it enforces it: `_shown(found, "a preemption")` fails with "the run never
shows a preemption" when nothing was found, and `_need(cond, None, "...")` fails on the whole run (no step) when a
precondition is missing ("the run set no num_gpu_blocks_override"). Reading those calls from the source (the
check and the module's private helpers it calls) gives `annotations verify` the list to print beside what was
seen, and gives the tests a way to refuse a check that requires nothing: such a check could pass on a run where
the case it proves never happens.
"""

from __future__ import annotations

import ast
import inspect
import sys
from functools import cache


def _literal(node: ast.expr) -> str | None:
    """A string argument as written: a constant, or an f-string with its fields shown as {...}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{…}" for v in node.values)
    return None


@cache
def requirements(check) -> tuple[str, ...]:
    """The whole-run requirements of `check`, each as the failure it raises when the run does not meet it, in
    source order, following the module's private helpers it calls."""
    module = sys.modules[check.__module__]
    out: list[str] = []
    seen: set[str] = set()

    def visit(fn) -> None:
        if fn.__name__ in seen:
            return
        seen.add(fn.__name__)
        for node in ast.walk(ast.parse(inspect.getsource(fn))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            name = node.func.id
            if name == "_shown" and len(node.args) == 2 and (text := _literal(node.args[1])):
                out.append(f"the run never shows {text}")  # _shown's own failure
            elif name == "_need" and len(node.args) == 3 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value is None and (text := _literal(node.args[2])):
                out.append(text)
            elif name.startswith("_") and callable(helper := getattr(module, name, None)) \
                    and getattr(helper, "__module__", None) == module.__name__:
                visit(helper)

    visit(check)
    return tuple(dict.fromkeys(out))
