"""A vLLM platform plugin read from its sources (tarball or directory), never imported.

A platform plugin (MACA: vllm-metax) cannot be imported without its hardware, its
SDK and its vendor's torch build. What it does to vLLM is still written in its
Python files, and this module reads it with `ast`:

- its entry points (pyproject.toml `[project.entry-points.*]`, setup.py `entry_points=`);
- the modules each entry point imports when vLLM calls it (module-level imports,
  imports and calls inside the entry point's function, and the class path a
  platform entry point returns: vLLM imports that class);
- the attention backends it registers under upstream's names
  (`register_backend(AttentionBackendEnum.X, class_path=...)` or the decorator);
- the upstream attributes it assigns at module level (`GPUModelRunner._may_reorder_batch = ...`):
  its patches, each with the entry points that apply it.
"""

from __future__ import annotations

import ast
import tarfile
import tempfile
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from vllm_tour.errors import TourError

PLATFORM_GROUP = "vllm.platform_plugins"
GENERAL_GROUP = "vllm.general_plugins"
REGISTER_BACKEND = "vllm.v1.attention.backends.registry.register_backend"
BACKEND_ENUM = "vllm.v1.attention.backends.registry.AttentionBackendEnum"
UPSTREAM = "vllm"  # patches of other packages (torch) are not vLLM's functions


@dataclass(frozen=True)
class EntryPoint:
    group: str
    name: str
    value: str  # "module:function"

    def __str__(self) -> str:
        return f"{self.name} = {self.value}"


@dataclass(frozen=True)
class Backend:
    name: str  # upstream's enum name: TRITON_ATTN
    class_path: str  # the plugin's class registered under it
    where: str  # file:line of the registration


@dataclass
class Patch:
    target: str  # upstream qualified name assigned to
    value: str  # the expression assigned, as written
    where: str  # file:line
    module: str  # the plugin module that assigns it
    applied_by: list[str] = field(default_factory=list)  # entry points whose import runs it


@contextmanager
def opened(source: Path) -> Iterator[Path]:
    """The plugin's source root (where setup.py / pyproject.toml are): `source` itself, or a tarball extracted
    to a temporary directory removed afterwards. TourError for anything unreadable."""
    source = Path(source)
    if source.is_dir():
        yield _root(source, source)
        return
    if not source.is_file():
        raise TourError(f"plugin sources {source}: no such file or directory")
    with tempfile.TemporaryDirectory(prefix="vllm-tour-plugin-") as tmp:
        try:
            with tarfile.open(source) as tar:  # .tar.xz, .tar.gz, .tar: compression by content
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, EOFError, OSError, ValueError) as e:
            first = (str(e).splitlines() or [""])[0]  # tarfile lists every compression it tried, one per line
            raise TourError(f"plugin sources {source}: not a readable tarball ({type(e).__name__}: {first})") from None
        yield _root(Path(tmp), source)


def _root(d: Path, source: Path) -> Path:
    """The shallowest directory holding pyproject.toml or setup.py (a `git archive --prefix` adds one level)."""
    found = sorted((p.parent for name in ("pyproject.toml", "setup.py") for p in d.rglob(name)), key=lambda p: len(p.parts))
    if not found:
        raise TourError(f"plugin sources {source}: no pyproject.toml or setup.py (is it a Python package's source?)")
    return found[0]


def parse_file(path: Path, label: str) -> ast.Module:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as e:
        raise TourError(f"plugin sources: {label} does not parse (line {e.lineno}: {e.msg})") from None
    except (UnicodeDecodeError, OSError) as e:
        raise TourError(f"plugin sources: cannot read {label} ({e})") from None


def entry_points(root: Path) -> list[EntryPoint]:
    """The vLLM entry points declared in pyproject.toml and setup.py (a literal `entry_points={...}`)."""
    out: list[EntryPoint] = []
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise TourError(f"plugin sources: pyproject.toml is malformed ({e})") from None
        for group, eps in data.get("project", {}).get("entry-points", {}).items():
            out += [EntryPoint(group, name, value) for name, value in eps.items()]
    setup = root / "setup.py"
    if setup.is_file():
        for node in ast.walk(parse_file(setup, "setup.py")):
            if isinstance(node, ast.keyword) and node.arg == "entry_points":
                try:
                    groups = ast.literal_eval(node.value)
                except ValueError:
                    continue  # computed: pyproject.toml's are the ones read
                for group, eps in groups.items():
                    for spec in eps:
                        name, _, value = spec.partition("=")
                        out.append(EntryPoint(group, name.strip(), value.strip()))
    vllm = [e for e in dict.fromkeys(out) if e.group.startswith("vllm.")]
    if not vllm:
        raise TourError(f"plugin sources {root}: declare no vllm.* entry points (pyproject.toml, setup.py)")
    return vllm


class Module:
    """One parsed source file: its imports as absolute names (wherever they are in the file), its top-level defs."""

    def __init__(self, name: str, path: Path, tree: ast.Module, is_package: bool):
        self.name, self.path, self.tree = name, path, tree
        package = name if is_package else name.rpartition(".")[0]
        self.aliases: dict[str, str] = {}  # local name -> absolute dotted name (imports anywhere in the file)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(package, node.module, node.level)
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{base}.{a.name}"
        self.defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}

    def absolute(self, expr: ast.expr) -> str | None:
        """The absolute dotted name of `a.b.c` in this module, when its root is imported or defined here."""
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        if expr.id in self.aliases:
            base = self.aliases[expr.id]
        elif expr.id in self.defs:
            base = f"{self.name}.{expr.id}"
        else:
            return None
        return ".".join([base, *reversed(parts)])


def _absolute(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the module is imported (into if/try/with blocks, not into defs or classes)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for attr in ("body", "orelse", "finalbody"):
                yield from top_level(getattr(node, attr, []))
            for h in getattr(node, "handlers", []):
                yield from top_level(h.body)


class PluginSource:
    """The plugin's packages under `root`, parsed on demand."""

    def __init__(self, root: Path):
        self.root = root
        self.entry_points = entry_points(root)
        self.packages = sorted({e.value.split(":")[0].split(".")[0] for e in self.entry_points})
        for p in self.packages:
            if not (root / p / "__init__.py").is_file():
                raise TourError(f"plugin sources {root}: entry points name package {p}, which is not there")
        self._modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        """A module of the plugin by dotted name; None when it is not the plugin's (vllm, torch) or no such file."""
        if name not in self._modules:
            base = self.root.joinpath(*name.split("."))
            found = None
            if name.split(".")[0] in self.packages:
                for path, is_pkg in ((base / "__init__.py", True), (base.with_suffix(".py"), False)):
                    if path.is_file():
                        found = Module(name, path, parse_file(path, path.relative_to(self.root).as_posix()), is_pkg)
                        break
            self._modules[name] = found
        return self._modules[name]

    def all_modules(self) -> list[Module]:
        out = []
        for p in self.packages:
            for path in sorted((self.root / p).rglob("*.py")):
                rel = path.relative_to(self.root).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                if (m := self.module(".".join(parts))) is not None:
                    out.append(m)
        return out

    def where(self, m: Module, node: ast.AST) -> str:
        return f"{m.path.relative_to(self.root).as_posix()}:{node.lineno}"

    # -- what importing / calling an entry point runs ---------------------------------------
    def reached(self, ep: EntryPoint) -> set[str]:
        """The plugin modules imported when vLLM loads `ep` and calls its function."""
        seen: set[str] = set()
        mod, _, func = ep.value.partition(":")
        self._import(mod, seen)
        m = self.module(mod)
        if m is not None and func in m.defs:
            self._call(m, m.defs[func], seen, set())
        return seen

    def _import(self, name: str, seen: set[str]) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a package's __init__ runs before its submodules
            dotted = ".".join(parts[:i])
            if dotted in seen or (m := self.module(dotted)) is None:
                continue
            seen.add(dotted)
            self._imports_in(m, list(top_level(m.tree.body)), seen)

    def _imports_in(self, m: Module, nodes, seen: set[str]) -> None:
        package = m.name if m.path.name == "__init__.py" else m.name.rpartition(".")[0]
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    self._import(a.name, seen)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(package, node.module, node.level)
                self._import(base, seen)
                for a in node.names:  # `from pkg import sub` imports the submodule
                    if self.module(f"{base}.{a.name}") is not None:
                        self._import(f"{base}.{a.name}", seen)

    def _call(self, m: Module, fn: ast.AST, seen: set[str], called: set[str]) -> None:
        key = f"{m.name}.{fn.name}"
        if key in called:
            return
        called.add(key)
        self._imports_in(m, list(ast.walk(fn)), seen)
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and (target := m.absolute(node.func)):
                mod, _, name = target.rpartition(".")
                callee = self.module(mod)
                if callee is not None and isinstance(callee.defs.get(name), (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._import(mod, seen)
                    self._call(callee, callee.defs[name], seen, called)
            elif isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                # a platform entry point returns its platform class's path: vLLM imports it
                mod = node.value.value.rpartition(".")[0]
                if self.module(mod) is not None:
                    self._import(mod, seen)

    # -- what it registers and patches ------------------------------------------------------
    def backends(self) -> list[Backend]:
        """Attention backends registered under upstream's enum names, by call or by class decorator."""
        out: list[Backend] = []
        for m in self.all_modules():
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Call) and m.absolute(node.func) == REGISTER_BACKEND:
                    args = {**dict(zip(("backend", "class_path"), node.args)), **{k.arg: k.value for k in node.keywords}}
                    enum, path = args.get("backend"), args.get("class_path")
                    name = _enum_member(m, enum)
                    if name and isinstance(path, ast.Constant) and isinstance(path.value, str):
                        out.append(Backend(name, path.value, self.where(m, node)))
                elif isinstance(node, ast.ClassDef):
                    for d in node.decorator_list:
                        if isinstance(d, ast.Call) and m.absolute(d.func) == REGISTER_BACKEND and d.args:
                            if name := _enum_member(m, d.args[0]):
                                out.append(Backend(name, f"{m.name}.{node.name}", self.where(m, d)))
        first: dict[tuple[str, str], Backend] = {}
        for b in out:  # platform.py's explicit registration before the same class's decorator
            first.setdefault((b.name, b.class_path), b)
        return list(first.values())

    def patches(self) -> list[Patch]:
        """Module-level assignments to upstream vLLM attributes, with the entry points that import them."""
        reached = {str(ep): self.reached(ep) for ep in self.entry_points}
        out: list[Patch] = []
        for m in self.all_modules():
            for node in top_level(m.tree.body):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and (name := m.absolute(t)) and name.split(".")[0] == UPSTREAM:
                        by = [ep for ep, mods in reached.items() if m.name in mods]
                        out.append(Patch(name, ast.unparse(node.value)[:80], self.where(m, node), m.name, by))
        return out

    def class_method_return(self, class_path: str, method: str) -> str | None:
        """The absolute name `class_path.method` returns (`return TritonAttentionMetadataBuilder`), if it is one name."""
        mod, _, cls = class_path.rpartition(".")
        m = self.module(mod)
        node = m.defs.get(cls) if m else None
        if not isinstance(node, ast.ClassDef):
            return None
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                for r in ast.walk(item):
                    if isinstance(r, ast.Return) and r.value is not None:
                        return m.absolute(r.value)
        return None


def _enum_member(m: Module, node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Attribute) and m.absolute(node.value) == BACKEND_ENUM:
        return node.attr
    return None
