"""`vllm-tour lab new`: skeletons generated from the reference keep its interface and leave the bodies to write."""

import ast
import os
import subprocess
import sys

import pytest

from vllm_tour.lab.catalog import LABS
from vllm_tour.lab.check import unwritten
from vllm_tour.lab.skeleton import skeleton_source
from vllm_tour.paths import REPO_ROOT
from vllm_tour.notes.annotations import all_notes, load_all


def lab(*args):
    """The command as a user runs it: exit code, one-line error on stderr."""
    return subprocess.run([sys.executable, "-m", "vllm_tour.cli", "lab", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})


def one_line_error(r) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def _defs(tree: ast.Module, names: tuple[str, ...]) -> dict[str, ast.FunctionDef]:
    """{qualname: def} of the given top-level functions and the methods of the given classes."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            out[node.name] = node
        elif isinstance(node, ast.ClassDef) and node.name in names:
            out.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    return out


@pytest.mark.parametrize("component", list(LABS))
def test_skeleton_has_the_references_signatures_and_no_bodies(component):
    lab = LABS[component]
    reference = _defs(ast.parse((REPO_ROOT / lab.reference).read_text()), lab.stub)
    skeleton_text = skeleton_source(lab)
    skeleton = _defs(ast.parse(skeleton_text), lab.stub)
    assert reference and list(skeleton) == list(reference)
    for name, ref in reference.items():
        mine = skeleton[name]
        assert ast.unparse(mine.args) == ast.unparse(ref.args), name
        assert ast.unparse(mine.returns or ast.Constant(None)) == ast.unparse(ref.returns or ast.Constant(None)), name
        assert ast.get_docstring(mine), f"{name}: no docstring saying what to write"
        assert ast.unparse(mine.body[-1]) == f"raise NotImplementedError('{name}: not written yet')"
    assert "from ." not in skeleton_text  # runs from any folder


def test_docstrings_cite_notes_by_id_and_upstream_by_name():
    pool = _defs(ast.parse(skeleton_source(LABS["block_pool"])), ("BlockPool",))
    doc = ast.get_docstring(pool["BlockPool.free_blocks"])
    assert "Upstream: `vllm.v1.core.block_pool.BlockPool.free_blocks`." in doc
    assert "Note pool-free-order: Freed blocks are split by value." in doc
    assert "vllm-tour source vllm.v1.core.block_pool.BlockPool.free_blocks" in doc


def test_every_cited_note_and_upstream_name_exists():
    from vllm_tour.notes.pinned import tree_for_pin

    notes = {n.id: n for n in all_notes(load_all())}
    tree = tree_for_pin()
    for lab in LABS.values():
        for qualname, refs in lab.reads.items():
            for ref in refs:
                symbol = ref if ref.startswith("vllm.") else notes[ref].symbol  # KeyError: no such note
                tree.resolve(symbol)  # NotFound: not in the pinned upstream source


@pytest.mark.parametrize("component", list(LABS))
def test_skeleton_cites_every_note_compares_registry_names(component):
    from vllm_tour.compare.components import COMPONENTS

    text = skeleton_source(LABS[component])
    assert " ".join(COMPONENTS[component].doc.split()) in " ".join(text.split())  # what upstream's counterpart does
    missing = [n for n in COMPONENTS[component].notes if f"Note {n}:" not in text]
    assert not missing, f"the {component} skeleton never points the learner at {missing}"


def test_paged_attention_takes_the_engines_types_from_the_reference():
    text = skeleton_source(LABS["paged_attention"])
    assert "from reimpl.paged_attn import slot_mapping, BatchMeta, PagedKVCache" in text
    assert "class PagedKVCache" not in text and "import BlockPool" not in text  # not copied, not re-exported


def test_new_writes_the_lab_and_check_names_what_is_unwritten(tmp_path):
    d = tmp_path / "pool"
    r = lab("new", "block_pool", d)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in d.iterdir()) == ["README.md", "block_pool.py", "lab.toml"]
    readme = (d / "README.md").read_text()
    assert f"vllm-tour lab check {d}" in readme
    assert (f"vllm-tour compare reimpl.chunked_prefill --impl block_pool={d}/block_pool.py:BlockPool \\\n"
            "    --scenario traces/scenarios/cmp_evict.toml --explain") in readme
    assert unwritten(d / "block_pool.py")[:2] == ["FreeBlockQueue.__init__", "FreeBlockQueue.__len__"]

    err = one_line_error(lab("check", d))
    assert "17 bodies in" in err and "still raise NotImplementedError (not written yet: FreeBlockQueue.__init__" in err


def test_new_refuses_unknown_component_and_others_work(tmp_path):
    assert "unknown lab component 'block_manager'" in one_line_error(lab("new", "block_manager", tmp_path / "x"))
    assert not (tmp_path / "x").exists()

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("my notes")
    assert "not empty and holds no lab" in one_line_error(lab("new", "scheduler", tmp_path / "notes"))
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["mine.txt"]


def test_new_never_overwrites_a_lab_without_force(tmp_path):
    d = tmp_path / "sched"
    assert lab("new", "scheduler", d).returncode == 0
    mine = d / "scheduler.py"
    mine.write_text(mine.read_text() + "\n# my work\n")
    assert "already holds a lab (scheduler)" in one_line_error(lab("new", "scheduler", d))
    assert mine.read_text().endswith("# my work\n")
    assert lab("new", "scheduler", d, "--force").returncode == 0
    assert not mine.read_text().endswith("# my work\n")
