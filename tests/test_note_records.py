"""The per-note record (annotations/records/notes.md) is current, and every note has a proof or a reason why not."""

import re

import pytest

from vllm_tour.notes import records
from vllm_tour.paths import REPO_ROOT


@pytest.fixture(scope="module")
def rows():
    return records.rows(records.trees())


def test_every_note_has_a_proof_or_a_reason(rows):
    assert records.problems(rows) == []


def test_checked_in_record_is_current(rows):
    assert records.RECORD.read_text(encoding="utf-8") == records.render(rows), \
        "annotations/records/notes.md is stale: run `vllm-tour annotations records --write`"


def test_readme_record_counts(rows):
    text = " ".join((REPO_ROOT / "README.md").read_text().split())
    m = re.search(r"record of all (\d+) notes: (\d+) proven on a live run, (\d+) with a one-line reason why not; "
                  r"(\d+) read whole .*?, (\d+) of them changed", text)
    assert m, "README's per-note record sentence changed shape: update this test with it"
    c = records.counts(rows)
    assert tuple(map(int, m.groups())) == (c["notes"], c["proven"], c["reason"], c["read_whole"], c["changed"])


def test_a_note_without_proof_or_reason_is_named(rows, tmp_path, monkeypatch):
    bare = [r for r in rows if not r.proven][0]
    bare = records.Row(bare.note, bare.lines, {}, records.Reason())
    assert records.problems([bare]) [0].startswith(f"{bare.note.id}: no proof and no reason")
