"""Anchors survive edits around them; a removed target is an orphan with a suggestion.

Each test edits a temp copy of a real upstream file from the installed pin, so
the resolver is exercised on vLLM's actual code, not on toy snippets.
"""

import ast
import shutil
from pathlib import Path

import pytest

from vllm_tour.upstream import pins
from vllm_tour.notes.annotations import Note
from vllm_tour.notes.check import check
from vllm_tour.notes.resolve import NotFound, SourceTree, normalize

SCHED = "vllm.v1.core.sched.scheduler.Scheduler.schedule"
ALLOC = "self.kv_cache_manager.allocate_slots("
REL = Path("v1/core/sched/scheduler.py")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    # the name index of a temp tree must not land in the user's cache
    monkeypatch.setenv("VLLM_TOUR_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tree_copy(tmp_path) -> SourceTree:
    src = pins.pin_sources("v0.32.0")
    root = tmp_path / "vllm"
    for rel in (REL, Path("v1/core/block_pool.py")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    return SourceTree(root, "copy")


def _methods(path: Path, cls: str) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [n for n in c.body if isinstance(n, ast.FunctionDef)]


def _note(symbol=SCHED, anchor=ALLOC, occurrence=1) -> Note:
    return Note(id="t", symbol=symbol, anchor=anchor, occurrence=occurrence, en="x", zh="中文")


def test_anchor_survives_blank_lines_and_renamed_neighbour(tree_copy):
    path = tree_copy.root / REL
    before = tree_copy.resolve(SCHED)
    hit = tree_copy.find(before, ALLOC)[0]
    assert ALLOC in hit.text and hit.span.start > before.span.start

    # the method defined just before schedule(), renamed; 7 blank lines above
    # the class and 3 inside schedule() before the anchored statement
    methods = _methods(path, "Scheduler")
    i = [m.name for m in methods].index("schedule")
    neighbour = methods[i - 1].name
    lines = path.read_text().splitlines(keepends=True)
    lines[methods[i - 1].lineno - 1] = lines[methods[i - 1].lineno - 1].replace(
        f"def {neighbour}(", f"def {neighbour}_renamed(")
    lines[hit.span.start - 1 : hit.span.start - 1] = ["\n"] * 3
    cls_line = next(n.lineno for n in ast.parse("".join(lines)).body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    lines[cls_line - 1 : cls_line - 1] = ["\n"] * 7
    path.write_text("".join(lines))

    after = SourceTree(tree_copy.root, "edited")
    sym = after.resolve(SCHED)
    assert sym.span.start == before.span.start + 7
    moved = after.find(sym, ALLOC)[0]
    assert moved.span.start == hit.span.start + 10
    assert moved.text == hit.text
    assert ALLOC in sym.lines[moved.span.start - 1] or ALLOC in moved.text.splitlines()[0]
    with pytest.raises(NotFound):
        after.resolve(f"vllm.v1.core.sched.scheduler.Scheduler.{neighbour}")
    assert after.resolve(f"vllm.v1.core.sched.scheduler.Scheduler.{neighbour}_renamed")


def test_anchor_survives_reformatting(tree_copy):
    path = tree_copy.root / REL
    sym = tree_copy.resolve(SCHED)
    hit = tree_copy.find(sym, ALLOC)[0]
    assert len(hit.text.splitlines()) > 1  # a multi-line call ...
    one_line = " " * (len(hit.text) - len(hit.text.lstrip())) + " ".join(x.strip() for x in hit.text.splitlines()) + "\n"
    text = path.read_text()
    path.write_text(text.replace(hit.text, one_line, 1))  # ... joined onto one line
    again = SourceTree(tree_copy.root, "reformatted")
    moved = again.find(again.resolve(SCHED), ALLOC)[0]
    assert moved.span.start == moved.span.end == hit.span.start
    assert normalize(moved.text) == normalize(hit.text)


def test_removed_target_is_orphan_with_suggestion(tree_copy):
    path = tree_copy.root / REL
    path.write_text(path.read_text().replace("    def schedule(self", "    def schedule_step(self", 1))
    bp = tree_copy.root / "v1/core/block_pool.py"
    gone = next(m for m in _methods(bp, "BlockPool") if m.name == "get_new_blocks")
    lines = bp.read_text().splitlines(keepends=True)
    del lines[gone.lineno - 1 : gone.end_lineno]
    bp.write_text("".join(lines))

    notes = [_note(), _note(symbol="vllm.v1.core.block_pool.BlockPool.get_new_blocks", anchor=None),
             _note(symbol="vllm.v1.core.block_pool.BlockPool.get_num_free_blocks", anchor=None)]
    rep = check({"copy": SourceTree(tree_copy.root, "copy")}, notes).pins[0]
    assert [p.ok for p in rep.placements] == [False, False, True]
    renamed, removed, _ = rep.placements
    assert renamed.suggestions[0] == "vllm.v1.core.sched.scheduler.Scheduler.schedule_step"
    assert "'schedule' not found" in renamed.problem
    assert removed.suggestions and all(s.startswith("vllm.v1.core.block_pool.BlockPool") for s in removed.suggestions)


def test_changed_anchor_text_is_orphan_with_nearest_statement(tree_copy):
    path = tree_copy.root / REL
    path.write_text(path.read_text().replace("self.kv_cache_manager.allocate_slots(", "self.kv_cache_manager.allocate_slots_v2("))
    rep = check({"copy": SourceTree(tree_copy.root, "copy")}, [_note()]).pins[0]
    (p,) = rep.placements
    assert not p.ok and "not in" in p.problem
    assert p.suggestions and "allocate_slots_v2(" in p.suggestions[0]


def test_occurrence_picks_the_nth_match(tree_copy):
    sym = tree_copy.resolve(SCHED)
    hits = tree_copy.find(sym, ALLOC)
    assert len(hits) >= 2  # schedule() allocates for running and for waiting requests
    rep = check({"copy": tree_copy}, [_note(occurrence=2), _note(occurrence=len(hits) + 1)]).pins[0]
    assert rep.placements[0].span == hits[1].span
    assert not rep.placements[1].ok


def test_module_and_nested_scopes(tree_copy):
    mod = tree_copy.resolve("vllm.v1.core.block_pool")
    assert mod.span.start == 1 and mod.span.end == len(mod.lines)
    with pytest.raises(NotFound) as e:
        tree_copy.resolve("vllm.v1.core.block_pool.BlockPool.get_new_block")
    assert "vllm.v1.core.block_pool.BlockPool.get_new_blocks" in str(e.value)
