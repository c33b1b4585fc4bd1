"""Check probe declarations against a pin's *sources*, without importing vLLM.

A pin that cannot be imported here (v0.21.0: CUDA-only wheel) is still checked
in CI: every target of `install.probes_for(pin, backend)` must resolve in the
pin's source tree (libcst, `vllm_tour.notes.resolve`) to a def whose leading
parameters are the probe's. Methods inherited from a base class are not
followed: a probe targets the class that defines the method.
"""

from __future__ import annotations

import ast
import textwrap

from vllm_tour.errors import TourError
from vllm_tour.probes.base import Probe


def source_params(tree, qualname: str) -> list[str]:
    """Parameter names of the def `qualname` in `tree` (a SourceTree); TourError if it is not a def."""
    sym = tree.resolve(qualname)  # NotFound (a TourError) names close names
    node = ast.parse(textwrap.dedent(sym.code)).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TourError(f"{qualname} is not a function on {tree.label}")
    a = node.args
    return [x.arg for x in (*a.posonlyargs, *a.args)] + ([a.vararg.arg] if a.vararg else []) + [x.arg for x in a.kwonlyargs]


def check_static(pin: str, tree, backends: list[str | None] | None = None, probes: list[Probe] | None = None) -> list[str]:
    """Problems (empty: all good) with the probes of `pin` on `tree`, for each backend declared for the pin."""
    from vllm_tour.probes.install import PROBES, probes_for

    probes = PROBES if probes is None else probes
    if backends is None:
        backends = sorted({p.backend for p in probes if p.backend and pin in p.pins}) or [None]
    problems: list[str] = []
    seen: set[str] = set()
    for backend in backends:
        try:
            chosen = probes_for(pin, backend, probes, serve=None)
        except TourError as e:
            problems.append(str(e))
            continue
        for p in chosen:
            if p.target in seen:
                continue
            seen.add(p.target)
            if (problem := target_problem(p, pin, tree)) is not None:
                problems.append(problem)
    return problems + [msg for p in {p.name + p.target: p for p in probes}.values() if pin in p.pins
                       for msg in hook_problems(p)]


def target_problem(p: Probe, pin: str, tree) -> str | None:
    """Why `p` cannot be installed on `pin` as its sources in `tree` stand (None: it can): not checked against
    the pin, its target missing (the qualified name and the close names), or other leading parameters."""
    if pin not in p.pins:
        return f"probe {p.name} has not been checked against pin {pin} (target {p.target})"
    try:
        names = source_params(tree, p.target)
    except TourError as e:
        return f"probe {p.name}: target {p.target} not found on pin {pin} ({e})"
    if tuple(names[: len(p.params)]) != p.params:
        return (f"probe {p.name}: target {p.target} on pin {pin} has parameters ({', '.join(names)}), "
                f"expected ({', '.join(p.params)}, ...)")
    return None


def hook_problems(p: Probe) -> list[str]:
    """A hook is called with the target's own arguments, positional or by keyword as the caller wrote them
    (v0.21.0's runner passes `layer=..., hidden_states=...`): it must accept every declared parameter both ways."""
    import inspect

    out = []
    hooks = (("before", p.before, ()), ("after", p.after, ("token", "result")))
    for kind, hook, lead in hooks:
        if hook is None:
            continue
        sig = inspect.signature(hook)
        for how, call in (("by position", lambda: sig.bind(*lead, *p.params)),
                          ("by keyword", lambda: sig.bind(*lead, p.params[0], **{n: n for n in p.params[1:]}))):
            try:
                call()
            except TypeError as e:
                out.append(f"probe {p.name}: its {kind} hook cannot take ({', '.join(p.params)}) {how}: {e}")
    return out
