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
    depends = ["vllm.v1.core.block_pool.BlockPool.free_blocks"]  # code the claim rests on beyond the anchor
                                               # (checked.py: its digests are kept; a change flags the note)
    en = "..."                                 # Markdown
    zh = "..."
    pins = ["v0.32.0", "v0.21.0"]              # the pins this text was checked against, and holds on
                                               # (default: the file's `pin`)
    not_on = ["v0.21.0"]                       # the note does not apply there (its code is missing or behaves
                                               # otherwise): not shown
    [note.variant."v0.21.0"]                   # this pin's own text (checked against that pin)
    en = "..."
    zh = "..."

Chinese texts are wrapped in the file like English ones, but Markdown turns a line break into a space, and
Chinese puts none between its characters nor beside its punctuation: on load, such a line break is joined without
one. Between a Chinese character and a Latin word the files write a space, and the line break, rendered as one,
stays (blank lines, list items, headings and code fences stay as written too).

On a pin the note is not checked on (in none of pins, not_on, variant) it is still shown, with a caution
that says so, and `annotations check` reports it: a note is a claim, and a claim about other code is
checked before it teaches.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from vllm_tour.errors import TourError
from vllm_tour.notes.concepts import CONCEPTS
from vllm_tour.paths import ANNOTATIONS_DIR

LANGS = ("en", "zh")
PROBE_KINDS = ("scheduler", "kv", "runner", "attention", "tp_shards", "collective", "moe", "abort")

CJK_WORD = "\u2e80-\u2fff\u3040-\u30ff\u3100-\u312f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # radicals, kana, ideographs
CJK_PUNCT = "\u3000-\u303f\ufe30-\ufe4f\uff00-\uffef"  # CJK punctuation, compatibility and fullwidth forms
CJK = CJK_WORD + CJK_PUNCT
_WORD = re.compile(f"[{CJK_WORD}]")
_PUNCT = re.compile(f"[{CJK_PUNCT}\u2014\u2018\u2019\u201c\u201d\u2026]")  # with the dashes, quotes, ellipsis it uses
_BLOCK_START = re.compile(r"\s*([-*+]\s|\d+[.)]\s|#|>|\||```|~~~)")  # Markdown does not run it into the line before
_BLOCK_LINE = re.compile(r"\s*(#|\||```|~~~)")  # ... nor the line after into it
_FENCE = re.compile(r"\s*(```|~~~)")


def _no_space_between(a: str, b: str) -> bool:
    return bool(_PUNCT.match(a) or _PUNCT.match(b) or (_WORD.match(a) and _WORD.match(b)))


def join_cjk_lines(text: str) -> str:
    """`text` with each wrapped line joined to the one before where Chinese puts no space between the two sides."""
    lines: list[str] = []
    in_fence = False
    for line in text.split("\n"):
        prev = lines[-1] if lines else ""
        if (lines and not in_fence and line.strip() and prev.strip()
                and not _BLOCK_START.match(line) and not _BLOCK_LINE.match(prev)
                and not prev.endswith(("  ", "\\"))  # a Markdown hard break stays one
                and _no_space_between(prev.rstrip()[-1], line.lstrip()[0])):
            lines[-1] = prev.rstrip() + line.lstrip()
        else:
            lines.append(line)
        if _FENCE.match(line):
            in_fence = not in_fence
    return "\n".join(lines)


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    en: str
    zh: str

    @field_validator("zh")
    @classmethod
    def _zh(cls, v: str) -> str:
        return join_cjk_lines(v)


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
    depends: list[str] = []  # qualified names of other code the claim rests on (source/checked.py)
    pins: list[str] = []  # checked against (and true on) these pins; filled with the file's pin when empty
    not_on: list[str] = []
    variant: dict[str, Variant] = {}
    subsystem: str = ""  # filled from the file
    caution: str = ""  # set by on_pin: shown on a pin it was not checked against

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", v):
            raise ValueError("lower-case letters, digits and '-' only (it is a URL fragment)")
        return v

    @field_validator("en", "zh")
    @classmethod
    def _text(cls, v: str, info: ValidationInfo) -> str:
        if not v.strip():
            raise ValueError("empty note text")
        return join_cjk_lines(v.strip()) if info.field_name == "zh" else v.strip()

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

    def status_on(self, pin: str) -> str:
        """applies | variant | not_applicable | unchecked: what this note is on `pin`."""
        if pin in self.variant:
            return "variant"
        if pin in self.pins:
            return "applies"
        return "not_applicable" if pin in self.not_on else "unchecked"

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
        return {**v, "zh": join_cjk_lines(v["zh"])}

    def symbols(self) -> list[str]:
        """Annotated symbols in the order their first note appears."""
        return list(dict.fromkeys(n.symbol for n in self.notes))


def read_toml(path: Path) -> dict:
    """A hand-written TOML file of the notes (proofs, reasons): an unreadable or malformed one is one error line."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TourError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise TourError(f"{path}: not valid TOML ({e})") from None


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
        n.pins = n.pins or [sub.pin]
        both = (set(n.pins) | set(n.variant)) & set(n.not_on)
        if both or set(n.pins) & set(n.variant):
            raise TourError(f"invalid annotation file {path}: note {n.id!r}: pin(s) {', '.join(sorted(both or set(n.pins) & set(n.variant)))} "
                            "listed twice among pins, variant and not_on (each pin is one of them)")
        for v in n.variant.values():
            v.en, v.zh = v.en.strip(), v.zh.strip()
            if not v.en or not v.zh:
                raise TourError(f"invalid annotation file {path}: note {n.id!r}: empty variant text")
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


CAUTION = {"en": "checked on {pins} only, not on this pin ({pin}): the code here may behave otherwise",
           "zh": "仅在 {pins} 上核对过，未在此 pin（{pin}）上核对：这里的代码可能有不同的行为"}


def caution_text(note: Note, lang: str, pin: str) -> str:
    return CAUTION[lang].format(pins=note.caution, pin=pin) if note.caution else ""


def on_pin(subs: list[Subsystem], pin: str) -> list[Subsystem]:
    """The subsystems as shown on `pin`: a note's variant text for that pin in place of its own, notes that do not
    apply there left out, and the ones not checked against it carrying a caution."""
    out = []
    for sub in subs:
        notes = []
        for n in sub.notes:
            status = n.status_on(pin)
            if status == "not_applicable":
                continue
            if status == "variant":
                n = n.model_copy(update={"en": n.variant[pin].en, "zh": n.variant[pin].zh})
            elif status == "unchecked":
                n = n.model_copy(update={"caution": ", ".join(n.pins + list(n.variant))})
            notes.append(n)
        out.append(sub.model_copy(update={"notes": notes}))
    return out
