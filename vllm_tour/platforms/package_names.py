"""Names bound in a package's sources (a pin's `vllm`, a plugin's `vllm_metax`), read with `ast`, never imported.

A patch assigns `module.Class.attr` or `module.name`: it fits the pin when that name
is bound there — by a def, a class, an assignment or an import (a re-export is followed
to where it is defined), or, for a class attribute, in one of the class's bases. A probe
target is a def there, with its parameters. `ast` rather than libcst: the check reads a
dozen of vLLM's largest files, which libcst parses a hundred times slower.
"""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.platforms.plugin_source import Module, parse_file, top_level

_MAX_HOPS = 12  # re-exports and base classes followed before giving up (a cycle would loop)


class PackageNames:
    def __init__(self, package_root: Path):
        self.root = Path(package_root)  # the `vllm` directory
        self._modules: dict[str, Module | None] = {}

    def _module(self, dotted: str) -> Module | None:
        if dotted not in self._modules:
            parts = dotted.split(".")
            found = None
            if parts[0] == self.root.name:
                base = self.root.parent.joinpath(*parts)
                for path, is_pkg in ((base / "__init__.py", True), (base.with_suffix(".py"), False)):
                    if path.is_file():
                        found = Module(dotted, path, parse_file(path, path.relative_to(self.root.parent).as_posix()), is_pkg)
                        break
            self._modules[dotted] = found
        return self._modules[dotted]

    def missing(self, qualname: str) -> str | None:
        """None when `qualname` is bound here; else why not, in words."""
        return self.lookup(qualname)[1]

    def params(self, qualname: str) -> list[str]:
        """Parameter names of the def `qualname`; TourError when it is not one here."""
        node, why = self.lookup(qualname)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise TourError(f"{qualname} is not a function in {self.root.name} ({why or 'bound to something else'})")
        a = node.args
        return [x.arg for x in (*a.posonlyargs, *a.args)] + ([a.vararg.arg] if a.vararg else []) + [x.arg for x in a.kwonlyargs]

    def lookup(self, qualname: str, hops: int = 0) -> tuple[ast.AST | None, str | None]:
        """(the statement that binds `qualname`, None), or (None, why it is not bound)."""
        if hops > _MAX_HOPS:
            return None, f"{qualname}: too many re-exports to follow"
        parts = qualname.split(".")
        for i in range(len(parts), 0, -1):
            if (mod := self._module(".".join(parts[:i]))) is not None:
                break
        else:
            return None, f"no module {parts[0]}"
        node, cls = mod.tree, None
        for j in range(i, len(parts)):
            found = _binding(node.body, parts[j])
            if found is None:
                for base in cls.bases if cls is not None else ():
                    if (b := mod.absolute(base)) and (inherited := self.lookup(".".join([b, *parts[j:]]), hops + 1))[0]:
                        return inherited
                return None, f"{parts[j]} is not defined in {'.'.join(parts[:j])}"
            if isinstance(found, (ast.Import, ast.ImportFrom)):
                return self.lookup(".".join([mod.aliases[parts[j]], *parts[j + 1 :]]), hops + 1)
            if not isinstance(found, ast.ClassDef):
                return found, None  # a def or a value: what it holds is not followed
            node, cls = found, found
        return node, None


def _binding(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last statement in `body` (through if/try blocks) that binds `name`."""
    found = None
    for node in top_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            found = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if name in names:
                found = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                found = node
    return found
