"""The house's layers, read from the code: no import circles, no import that points up.

LAYERS is the one place the order lives (README's architecture section reads the same).
Every import counts, lazy ones inside functions too: a lazy import is still a dependency.
A module may import its own package and anything on a lower floor; two packages on one
floor never import each other.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "vllm_tour"

LAYERS = [  # bottom to top
    ["errors"],
    ["paths"],
    ["trace"],            # the record model: schema, writer, reader
    ["scenario"],
    ["upstream"],         # what a pin and a model are; doctor
    ["probes"],
    ["engine"],           # running upstream with probes: offline, scheduler-only, golden runs
    ["compare", "repro"],
    ["notes"],            # annotations, anchors, drift checks, proofs
    ["views"],            # terminal views, Perfetto
    ["site"],
    ["bench"],
    ["gpu", "lab", "platforms"],  # the GPU runner reuses bench's race recipe
    ["cli"],
    ["__main__", ""],     # "" is the package face, vllm_tour/__init__.py: load_run
]
FLOOR = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def modules(root: Path = PKG) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        name = ".".join(("vllm_tour",) + path.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def owner(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(mods) -> dict[str, set[str]]:
    """module -> the vllm_tour modules it imports (a `from pkg import sub` names the submodule)."""
    edges = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                o = owner(t, mods)
                if o and o != mod:
                    found.add(o)
        edges[mod] = found
    return edges


def part(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else ""


def test_every_part_has_a_floor():
    missing = sorted({part(m) for m in modules()} - set(FLOOR))
    assert not missing, f"add these to LAYERS in tests/test_layers.py: {missing}"


def upward_imports(root: Path = PKG) -> list[str]:
    """Imports of a part on the same or a higher floor than the importer's (its own part excepted)."""
    wrong = []
    for mod, targets in imports(modules(root)).items():
        for t in targets:
            a, b = part(mod), part(t)
            if a != b and FLOOR[b] >= FLOOR[a]:
                wrong.append(f"{mod} (floor {FLOOR[a]}) imports {t} (floor {FLOOR[b]})")
    return sorted(wrong)


def circles(root: Path = PKG) -> list[str]:
    """Files that import each other in a loop (Tarjan's strongly connected components of two or more)."""
    edges = imports(modules(root))
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(" <-> ".join(sorted(scc)))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_points_up_or_sideways():
    wrong = upward_imports()
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    found = circles()
    assert not found, "\n".join(found)


def test_the_checker_sees_a_planted_circle_and_an_upward_import(tmp_path):
    """The checks above can fail: a lower floor importing a higher one, and two files in a loop."""
    pkg = tmp_path / "vllm_tour"
    (pkg / "trace").mkdir(parents=True)
    (pkg / "views").mkdir()
    for f in ["__init__.py", "trace/__init__.py", "views/__init__.py"]:
        (pkg / f).write_text("")
    (pkg / "trace" / "schema.py").write_text("from vllm_tour.views import show\n")
    (pkg / "views" / "show.py").write_text("from vllm_tour.trace.schema import X\n")
    assert imports(modules(pkg))["vllm_tour.trace.schema"] == {"vllm_tour.views.show"}
    assert "vllm_tour.trace.schema (floor 2) imports vllm_tour.views.show (floor 9)" in upward_imports(pkg)
    assert "vllm_tour.trace.schema <-> vllm_tour.views.show" in circles(pkg)
