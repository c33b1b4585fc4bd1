"""`vllm-tour source` and `vllm-tour annotations check`, run as a user runs them."""

import contextlib
import io
import json
import re

import pytest
from rich.console import Console

from vllm_tour.notes.annotations import all_notes, load_all, on_pin
from vllm_tour.notes.pinned import tree_for_pin
from vllm_tour.paths import ANNOTATIONS_DIR
from vllm_tour.site.commands import run_check

SCHED = "vllm.v1.core.sched.scheduler.Scheduler.schedule"


@pytest.fixture(scope="module")
def schedule_en(cli) -> str:
    r = cli("source", SCHED)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_source_shows_notes_in_place(schedule_en):
    out = schedule_en.splitlines()
    sym = tree_for_pin("v0.32.0").resolve(SCHED)
    alloc = tree_for_pin("v0.32.0").find(sym, "self.kv_cache_manager.allocate_slots(")[0]
    # the anchored lines carry a gutter marker ...
    first = next(i for i, l in enumerate(out) if re.match(rf"\s*{alloc.span.start} ▌", l))
    assert "self.kv_cache_manager.allocate_slots(" in out[first]
    # ... and the note's panel opens right after the anchored statement's last line
    panel = next(i for i, l in enumerate(out) if "sched-allocate-running" in l)
    assert re.match(rf"\s*{alloc.span.end} ▌", out[panel - 1]), out[panel - 1]
    assert "Reserve KV slots for the new tokens" in "\n".join(out[panel : panel + 6])
    # a note on the whole symbol comes before the code
    assert schedule_en.index("sched-no-phases") < schedule_en.index(f"{sym.span.start} │")
    n = sum(1 for x in all_notes(on_pin(load_all(), "v0.32.0")) if x.symbol == SCHED)  # a note not on the pin is hidden
    assert f"{n} notes" in out[0]


def test_source_in_chinese(schedule_en, cli):
    r = cli("source", SCHED, "--lang", "zh")
    assert r.returncode == 0, r.stderr
    assert "牺牲者" in r.stdout and "注解 · sched-pick-victim" in r.stdout
    assert "The FCFS victim" not in r.stdout and "The FCFS victim" in schedule_en


def test_unknown_symbol_is_one_line_with_suggestions(cli):
    r = cli("source", "vllm.v1.core.sched.scheduler.Scheduler.schedul")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown symbol")
    assert "did you mean: vllm.v1.core.sched.scheduler.Scheduler.schedule" in lines[0]


def test_unknown_language_and_pin_are_errors(cli):
    assert cli("source", SCHED, "--lang", "fr").returncode == 2
    r = cli("source", SCHED, "--pin", "v9.9.9")
    assert r.returncode == 2 and "known pins" in r.stderr


def test_content_is_bilingual_and_covers_the_journey():
    subs = load_all()
    notes = all_notes(subs)
    assert len(notes) >= 60
    cjk = re.compile(r"[\u4e00-\u9fff]")
    for n in notes:
        assert len(cjk.findall(n.zh)) >= 20, n.id  # real Chinese prose, not a copy of the English
        assert not cjk.search(n.en), n.id
        assert len(n.en.split()) >= 20, n.id
    concepts = {c for n in notes for c in n.concepts}
    assert {"admission", "chunked-prefill", "preemption", "prefix-hit", "eviction", "slot-mapping",
            "block-table", "sampling", "tp-fanout"} <= concepts
    assert [s.name for s in subs][:3] == ["entrypoint", "engine_core", "scheduler"]
    # "see" targets are annotated symbols or note ids, so the site can link them
    ids = {n.id for n in notes}
    symbols = {n.symbol for n in notes}
    for n in notes:
        for t in n.see:
            assert t in ids or t in symbols or tree_for_pin("v0.32.0").resolve(t), (n.id, t)


def _check(pins: list[str], as_json: bool) -> tuple[int, str]:
    # in-process, through the same function the CLI calls, so both pins' trees
    # (parsed once, cached in tree_for_pin) serve the JSON and the table runs
    buf = io.StringIO()
    console = Console(file=buf, width=200, color_system=None)
    with contextlib.redirect_stdout(buf):
        code = run_check(console, pins, as_json)
    return code, buf.getvalue()


@pytest.mark.fetches_wheel  # runs in CI too: downloads vllm==0.21.0 once (cached), see pins/v0.21.0.toml
def test_check_two_pins_reports_counts_orphans_unchecked_and_drift():
    notes = all_notes(load_all())
    n = len(notes)
    code, out = _check(["v0.32.0", "v0.21.0"], as_json=True)
    rep = {p["pin"]: p for p in json.loads(out)["pins"]}
    new, old = rep["v0.32.0"], rep["v0.21.0"]
    # the notes are written for v0.32.0: all resolve there but those marked `not_on` it (a note about another
    # pin's code), and none can drift against itself
    on_new = [x for x in notes if x.status_on("v0.32.0") in ("applies", "variant")]
    assert new["resolved"] == len(on_new) and new["resolved"] + new["not_shown"] == n
    assert new["orphaned"] == 0 and new["drifted"] == 0 and new["unchecked"] == []
    claimed = [x for x in notes if x.status_on("v0.21.0") in ("applies", "variant")]
    assert old["resolved"] + old["orphaned"] == len(claimed)
    assert old["resolved"] + old["orphaned"] + len(old["unchecked"]) + old["not_shown"] == n
    # every note is checked on both pins (applies, has a variant, or is marked not_on), rests on the code it was
    # accepted against, and every drift between the pins was read
    assert code == 0 and old["unchecked"] == [] and old["orphaned"] == 0 and old["stale"] == {} and old["unrecorded"] == []
    assert 0 < old["drifted"] and all(d["reviewed"] for d in old["drift"])
    for o in old["orphans"]:
        assert o["problem"]
    # a drifted anchor names its lines on both pins, and whether someone read the code there
    assert all(d["base"].startswith("vllm/") and d["here"].startswith("vllm/") for d in old["drift"])
    assert all(d["reviewed"] == (d["id"] in {x.id for x in claimed}) for d in old["drift"])

    code2, table = _check(["v0.32.0", "v0.21.0"], as_json=False)
    assert code2 == code
    # one row per count, one column per pin (v0.32.0, then v0.21.0)
    want = {"resolved": old["resolved"], "orphaned": old["orphaned"], "unchecked": len(old["unchecked"]),
            "stale": len(old["stale"]), "unrecorded": len(old["unrecorded"]), "not shown": old["not_shown"],
            "drifted": old["drifted"]}
    for name, value in want.items():
        assert re.search(rf"│ {name}\s*│\s*\S+\s*│\s*{value}\s*│", table), (name, table)


@pytest.mark.fetches_wheel
def test_per_pin_applicability_decides_what_is_shown_and_checked(tmp_path, monkeypatch):
    """A note says where it was checked (`pins`), where it does not apply (`not_on`) and a pin's own text
    (`variant`); unchecked on a pin whose code has it, it is shown with a caution and check fails."""
    from vllm_tour.notes import checked
    from vllm_tour.notes.annotations import on_pin
    from vllm_tour.site import commands

    monkeypatch.setattr(checked, "CHECKED_FILE", tmp_path / "checked.json")  # each variant accepted, as reviewed
    src = (ANNOTATIONS_DIR / "block_pool.toml").read_text(encoding="utf-8")
    first = src.index("[[note]]")
    head, body = src[:first], src[first:]
    one = body.split("[[note]]")[1]  # pool-null-block: BlockPool.__init__ exists on both pins
    assert 'id = "pool-null-block"' in one
    # the note as if nobody had checked it yet: each case below adds its own marking
    one = re.sub(r"^(pins|not_on) = .*\n", "", one.split("[note.variant.")[0], flags=re.M)
    variants = {
        "unchecked": "",
        "applies": 'pins = ["v0.32.0", "v0.21.0"]\n',
        "not_on": 'not_on = ["v0.21.0"]\n',
        "variant": '[note.variant."v0.21.0"]\nen = "Old text."\nzh = "旧文本。"\n',
    }
    got = {}
    for kind, extra in variants.items():
        d = tmp_path / kind
        d.mkdir()
        (d / "block_pool.toml").write_text(head + "[[note]]" + one.rstrip() + "\n" + extra, encoding="utf-8")
        monkeypatch.setattr(commands, "load_all", lambda d=d: load_all(d))
        (tmp_path / "checked.json").unlink(missing_ok=True)
        commands.run_check(Console(file=io.StringIO()), ["v0.32.0", "v0.21.0"], False, accept_all=True)
        code, out = _check(["v0.32.0", "v0.21.0"], as_json=True)
        old = {p["pin"]: p for p in json.loads(out)["pins"]}["v0.21.0"]
        shown = [x for s in on_pin(load_all(d), "v0.21.0") for x in s.notes]
        got[kind] = (code, old["unchecked"], old["resolved"], [(x.en[:8], x.caution) for x in shown])
    assert got["unchecked"] == (1, ["pool-null-block"], 0, [("Block 0 ", "v0.32.0")])
    assert got["applies"] == (0, [], 1, [("Block 0 ", "")])
    assert got["not_on"] == (0, [], 0, [])
    assert got["variant"] == (0, [], 1, [("Old text", "")])
    # the caution is what `source --pin` prints beside an unchecked note
    from vllm_tour.notes.annotations import caution_text

    note = next(x for s in on_pin(load_all(tmp_path / "unchecked"), "v0.21.0") for x in s.notes)
    assert caution_text(note, "en", "v0.21.0").startswith("checked on v0.32.0 only, not on this pin (v0.21.0)")


def test_a_pin_listed_twice_is_an_error(tmp_path):
    from vllm_tour.errors import TourError
    from vllm_tour.notes.annotations import load_file

    src = (ANNOTATIONS_DIR / "block_pool.toml").read_text(encoding="utf-8")
    bad = tmp_path / "block_pool.toml"
    bad.write_text(src.replace('id = "pool-null-block"\n', 'id = "pool-null-block"\nnot_on = ["v0.32.0"]\n', 1), encoding="utf-8")
    with pytest.raises(TourError, match="pool-null-block.*v0.32.0 listed twice"):
        load_file(bad)


def test_check_installed_pin_is_clean(cli):
    r = cli("annotations", "check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ambiguous" not in r.stdout.split("┘")[-1]  # no ambiguity warnings below the table


def test_an_unknown_key_in_an_annotation_file_is_an_error_naming_file_note_and_key(tmp_path):
    from vllm_tour.errors import TourError
    from vllm_tour.notes.annotations import load_file
    from vllm_tour.paths import ANNOTATIONS_DIR

    src = next(p for p in sorted(ANNOTATIONS_DIR.glob("*.toml")) if "\nanchor = " in p.read_text(encoding="utf-8"))
    bad = tmp_path / src.name
    bad.write_text(src.read_text(encoding="utf-8").replace("\nanchor = ", "\nanchr = ", 1), encoding="utf-8")
    load_file(src)  # the original loads
    with pytest.raises(TourError, match="unknown key 'anchr'") as e:
        load_file(bad)
    assert str(bad) in str(e.value) and "note '" in str(e.value) and "\n" not in str(e.value)


def test_accepted_notes_go_stale_when_their_code_changes(tmp_path, monkeypatch):
    """--accept records the digests of a note's anchor and `depends`; a digest that no longer matches (the pin's
    code changed since) makes the note stale, naming the piece; a `depends` name missing on the pin is an error."""
    from vllm_tour.notes import checked
    from vllm_tour.site import commands

    monkeypatch.setattr(checked, "CHECKED_FILE", tmp_path / "checked.json")
    src = (ANNOTATIONS_DIR / "block_pool.toml").read_text(encoding="utf-8")
    d = tmp_path / "ann"
    d.mkdir()
    free = "vllm.v1.core.block_pool.BlockPool.free_blocks"
    assert f'id = "pool-free-queue"\ndepends = ["{free}"]\n' in src  # the queue's order rests on free_blocks
    (d / "block_pool.toml").write_text(src, encoding="utf-8")
    monkeypatch.setattr(commands, "load_all", lambda: load_all(d))
    n = len(all_notes(load_all(d)))

    def report():
        code, out = _check(["v0.32.0"], as_json=True)
        return code, json.loads(out)["pins"][0]

    code, rep = report()
    assert code == 1 and len(rep["unrecorded"]) == n  # nobody accepted anything yet
    buf = io.StringIO()
    assert commands.run_check(Console(file=buf, width=200), ["v0.32.0"], False, accept_all=True) == 0
    stored = json.loads((tmp_path / "checked.json").read_text())
    assert set(stored["pool-free-queue"]["v0.32.0"]) == {"anchor", free}
    code, rep = report()
    assert code == 0 and rep["unrecorded"] == [] and rep["stale"] == {}
    stored["pool-free-queue"]["v0.32.0"][free] = "0" * 16  # as if free_blocks read otherwise when it was accepted
    stored["pool-null-block"]["v0.32.0"]["anchor"] = "0" * 16
    (tmp_path / "checked.json").write_text(json.dumps(stored))
    code, rep = report()
    assert code == 1 and rep["stale"] == {"pool-free-queue": [free], "pool-null-block": ["anchor"]}
    code, table = _check(["v0.32.0"], as_json=False)
    assert f"stale v0.32.0 pool-free-queue: the code it rests on changed since it was accepted ({free})" in " ".join(table.split())
    with pytest.raises(Exception, match="--accept: no note 'nope'"):
        commands.run_check(Console(file=io.StringIO()), ["v0.32.0"], False, accept=["nope"])
    (d / "block_pool.toml").write_text(src.replace(f'depends = ["{free}"]', 'depends = ["vllm.v1.core.block_pool.BlockPool.gone"]', 1),
                                       encoding="utf-8")
    code, rep = report()
    assert code == 1 and rep["missing_depends"] == {"pool-free-queue": ["vllm.v1.core.block_pool.BlockPool.gone"]}


@pytest.mark.fetches_wheel
def test_diff_prints_the_drifted_code_between_pins():
    code, out = _check(["v0.32.0", "v0.21.0"], as_json=True)
    drifted = json.loads(out)["pins"][1]["drift"]
    assert drifted
    buf = io.StringIO()
    console = Console(file=buf, width=200, color_system=None)
    with contextlib.redirect_stdout(buf):
        run_check(console, ["v0.32.0", "v0.21.0"], False, show_diff=True)
    text = buf.getvalue()
    first = drifted[0]
    assert f"--- v0.32.0 {first['base']}" in text and f"+++ v0.21.0 {first['here']}" in text
    assert re.search(r"^\s*[-+][^-+]", text, re.M)  # changed lines, not only the ranges
