"""Annotation files: `annotations/<subsystem>.toml`, bilingual notes on upstream code.

One file per subsystem along the request path; `order` places it in the
journey. Each note names its upstream symbol by qualified name and, optionally,
a finer anchor — a piece of code text inside that symbol — never a line number:

    [[note]]
    id = "sched-allocate"                      # unique across all files; a URL fragment
    symbol = "vllm.v1.core.sched.scheduler.Scheduler.schedule"
    anchor = "self.kv_cache_manager.allocate_slots("   # optional
    occurrence = 1                             # optional: the n-th statement containing anchor
    probes = ["scheduler", "kv"]               # trace record kinds that show this code at work
    concepts = ["preemption"]                  # trace concepts that link here (see concepts.py)
    see = ["vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"]  # symbols or note ids
    en = "..."                                 # Markdown
    zh = "..."
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import TourError
from ..paths import ANNOTATIONS_DIR
from .concepts import CONCEPTS

LANGS = ("en", "zh")
PROBE_KINDS = ("scheduler", "kv", "runner", "attention", "tp_shards", "collective", "moe")


class Note(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key (`anchr`) would silently widen the note

    id: str
    symbol: str
    anchor: str | None = None
    occurrence: int | None = Field(None, ge=1)  # None: the anchor must match once (else "ambiguous")
    en: str
    zh: str
    probes: list[str] = []
    concepts: list[str] = []
    see: list[str] = []
    subsystem: str = ""  # filled from the file

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", v):
            raise ValueError("lower-case letters, digits and '-' only (it is a URL fragment)")
        return v

    @field_validator("en", "zh")
    @classmethod
    def _text(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty note text")
        return v.strip()

    @field_validator("probes")
    @classmethod
    def _probes(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if p not in PROBE_KINDS]
        if bad:
            raise ValueError(f"unknown probe kind {bad}; known: {', '.join(PROBE_KINDS)}")
        return v

    @field_validator("concepts")
    @classmethod
    def _concepts(cls, v: list[str]) -> list[str]:
        bad = [c for c in v if c not in CONCEPTS]
        if bad:
            raise ValueError(f"unknown concept {bad}; known: {', '.join(CONCEPTS)}")
        return v

    @property
    def nth(self) -> int:
        return self.occurrence or 1

    def text(self, lang: str) -> str:
        return self.zh if lang == "zh" else self.en


class Subsystem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""  # the file stem
    order: int
    pin: str  # the pin the notes were written (and checked) against
    title: dict[str, str]
    intro: dict[str, str]
    notes: list[Note] = Field(default_factory=list, alias="note")

    @field_validator("title", "intro")
    @classmethod
    def _bilingual(cls, v: dict[str, str]) -> dict[str, str]:
        missing = [lang for lang in LANGS if not v.get(lang, "").strip()]
        if missing:
            raise ValueError(f"missing language(s) {missing}")
        return v

    def symbols(self) -> list[str]:
        """Annotated symbols in the order their first note appears."""
        return list(dict.fromkeys(n.symbol for n in self.notes))


def load_file(path: Path) -> Subsystem:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TourError(f"malformed annotation file {path}: {e}") from None
    try:
        sub = Subsystem.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        if first["type"] == "extra_forbidden":
            loc = first["loc"]
            notes = data.get("note") if isinstance(data.get("note"), list) else []
            owner = f"note {notes[loc[1]].get('id', loc[1])!r}: " if loc[0] == "note" and len(loc) == 3 else ""
            raise TourError(f"invalid annotation file {path}: {owner}unknown key {loc[-1]!r}") from None
        raise TourError(f"invalid annotation file {path}: {where}: {first['msg']}") from None
    sub.name = path.stem
    for n in sub.notes:
        n.subsystem = sub.name
    return sub


def load_all(directory: Path | None = None) -> list[Subsystem]:
    """All subsystems in journey order; note ids must be unique across files."""
    directory = directory or ANNOTATIONS_DIR
    subs = sorted((load_file(p) for p in sorted(directory.glob("*.toml"))), key=lambda s: (s.order, s.name))
    seen: dict[str, str] = {}
    for s in subs:
        for n in s.notes:
            if n.id in seen:
                raise TourError(f"duplicate note id '{n.id}' in {s.name}.toml and {seen[n.id]}.toml")
            seen[n.id] = s.name
    return subs


def all_notes(subs: list[Subsystem]) -> list[Note]:
    return [n for s in subs for n in s.notes]


def notes_for(subs: list[Subsystem], qualname: str) -> list[Note]:
    return [n for n in all_notes(subs) if n.symbol == qualname]
