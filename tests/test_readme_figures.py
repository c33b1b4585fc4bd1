"""README's note counts are the annotations' own: a note added or re-pinned without updating README fails here."""

import re

from vllm_tour.notes.annotations import all_notes, load_all
from vllm_tour.paths import REPO_ROOT


def test_readme_note_counts_match_the_annotations():
    text = " ".join((REPO_ROOT / "README.md").read_text().split())
    m = re.search(r"Today: (\d+) notes, (\d+) checked on v0\.32\.0, (\d+) checked on v0\.21\.0 \((\d+) with their own "
                  r"v0\.21\.0 text\), (\d+) marked `not_on` v0\.21\.0", text)
    assert m, "README's 'Today: N notes, ...' sentence changed shape: update this test with it"
    notes = all_notes(load_all())
    actual = (len(notes), sum("v0.32.0" in n.pins for n in notes), sum("v0.21.0" in n.pins for n in notes),
              sum("v0.21.0" in n.variant for n in notes), sum("v0.21.0" in n.not_on for n in notes))
    assert tuple(map(int, m.groups())) == actual


def test_readme_glossary_count_matches_the_glossary():
    from vllm_tour.notes.glossary import load_glossary

    text = " ".join((REPO_ROOT / "README.md").read_text().split())
    m = re.search(r"`annotations/glossary/terms\.toml`: (\d+) terms", text)
    assert m, "README's glossary sentence changed shape: update this test with it"
    assert int(m.group(1)) == len(load_glossary())
