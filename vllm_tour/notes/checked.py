"""What code each note was checked against: `annotations/checked.json`, a digest per note, pin and piece of code.

A note's claim rests on its anchored code and on the code it lists in `depends` (other functions whose
behaviour the claim describes: the free queue's order depends on `BlockPool.free_blocks`, not only on the
queue class it is anchored in). When an author has read that code on a pin and finds the note true there,
`vllm-tour annotations check --pin P --accept ID` stores the digests (sha256 of the code without whitespace).
`annotations check` recomputes them: a changed digest means the note describes code that is no longer the
code its author read (stale), a missing one that nobody accepted the note on that pin (unrecorded).

    {"pool-free-queue": {"v0.32.0": {"anchor": "3f1c…", "vllm.v1.core.block_pool.BlockPool.free_blocks": "9a0e…"}}}
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.notes.annotations import Note
from vllm_tour.notes.locate import Placement
from vllm_tour.notes.resolve import NotFound, SourceTree, normalize
from vllm_tour.paths import ANNOTATIONS_DIR

CHECKED_FILE = ANNOTATIONS_DIR / "checked.json"
ANCHOR = "anchor"  # the key of the anchored code itself; the others are qualified names from `depends`


def digest(code: str) -> str:
    return hashlib.sha256(normalize(code).encode()).hexdigest()[:16]


def load_checked(path: Path | None = None) -> dict[str, dict[str, dict[str, str]]]:
    path = path or CHECKED_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TourError(f"unreadable {path}: {e}") from None
    if not isinstance(data, dict):
        raise TourError(f"malformed {path}: expected an object of note ids")
    return data


def save_checked(data: dict, path: Path | None = None) -> None:
    from vllm_tour.trace.writer import write_json_atomic

    write_json_atomic(path or CHECKED_FILE, {k: data[k] for k in sorted(data)})


def current(note: Note, placement: Placement, tree: SourceTree) -> tuple[dict[str, str], list[str]]:
    """(digests of the code the note rests on at this pin, the `depends` names that do not resolve here)."""
    out = {ANCHOR: digest(placement.text)}
    missing = []
    for q in note.depends:
        try:
            out[q] = digest(tree.resolve(q).code)
        except NotFound:
            missing.append(q)
    return out, missing


def changed(stored: dict[str, str], now: dict[str, str]) -> list[str]:
    """The pieces whose code differs from what was accepted (a `depends` entry added since counts too)."""
    return [k for k in now if stored.get(k) != now[k]] + [k for k in stored if k not in now]
