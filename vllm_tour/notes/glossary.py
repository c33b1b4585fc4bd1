"""The glossary (术语表): one Chinese rendering per term the notes use (annotations/glossary/terms.toml).

Two uses. `annotations lint` flags a term rendered another way (a term's `avoid` patterns; zh_lint.py), so the
notes read as one book. And a page glosses each term's first use with its English in fullwidth parentheses
(预填充（prefill）): the notes write only the Chinese, and a reader who meets a term on any page learns the
English word upstream's code uses for it. The site has the whole table as a page (site/html.py).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.paths import ANNOTATIONS_DIR

GLOSSARY_FILE = ANNOTATIONS_DIR / "glossary" / "terms.toml"
_CODE_SPAN = re.compile(r"`[^`]*`")
# An English gloss right after a term, as a text may write it itself: 持久批次（persistent batch）
LATIN_GLOSS = re.compile(r"（[\x20-\x7e]+）")


@dataclass(frozen=True)
class Term:
    en: str
    zh: str
    avoid: tuple[str, ...]  # other renderings, as the file writes them
    en_def: str
    zh_def: str

    def misrendered(self, text: str) -> list[re.Match]:
        """Where `text` renders this term another way: an English word whole (any case, plural too); a Chinese
        one outside this term's own rendering (预填 is wrong, the 预填 of 预填充 is not)."""
        masked = text.replace(self.zh, "\0" * len(self.zh))
        return [m for p in _patterns(self.avoid) for m in p.finditer(masked)]


@cache
def _patterns(avoid: tuple[str, ...]) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(rf"(?<![A-Za-z_]){re.escape(a)}s?(?![A-Za-z_])", re.IGNORECASE) if a.isascii()
                 else re.compile(re.escape(a)) for a in avoid)


@cache
def load_glossary(path: Path = GLOSSARY_FILE) -> tuple[Term, ...]:
    """The terms, checked: one entry per English and per Chinese term, and no term avoiding another's rendering
    (the lint would then flag a right word)."""
    try:
        rows = tomllib.loads(path.read_text(encoding="utf-8"))["term"]
        terms = tuple(Term(r["en"], r["zh"], tuple(r.get("avoid", [])), r["en_def"], r["zh_def"]) for r in rows)
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise TourError(f"bad glossary {path}: {e}") from None
    for key in ("en", "zh"):
        seen = [getattr(t, key) for t in terms]
        twice = sorted({s for s in seen if seen.count(s) > 1})
        if twice:
            raise TourError(f"bad glossary {path}: {key} term(s) listed twice: {', '.join(twice)}")
    for t in terms:
        for other in terms:
            if t.misrendered(other.zh):
                raise TourError(f"bad glossary {path}: {t.en!r} avoids {other.zh!r}, the rendering of {other.en!r}")
    return terms


def misrenderings(zh: str) -> list[tuple[Term, re.Match, str]]:
    """(term, match, the text searched) for every other rendering of a glossary term in one Chinese text; code
    spans and English glosses in parentheses are not Chinese and are skipped."""
    text = LATIN_GLOSS.sub("（…）", _CODE_SPAN.sub("`…`", zh))
    return [(t, m, text) for t in load_glossary() for m in t.misrendered(text)]


class FirstUse:
    """Glosses each term's first use on one page: call it on the page's Chinese texts in reading order."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        # longest first: 分块预填充 is one term, not 分块 + 预填充
        terms = sorted((t for t in load_glossary() if t.zh != t.en), key=lambda t: -len(t.zh))
        self._by_zh = {t.zh: t for t in terms}
        self._any = re.compile("|".join(re.escape(t.zh) for t in terms))

    def __call__(self, zh: str) -> str:
        parts = re.split(r"(`[^`]*`)", zh)
        return "".join(p if p.startswith("`") else self._gloss(p) for p in parts)

    def _gloss(self, text: str) -> str:
        out, last = [], 0
        for m in self._any.finditer(text):
            term = self._by_zh[m.group()]
            if term.en in self.seen:
                continue
            if text.startswith("（", m.end()):
                if text.lower().startswith(f"（{term.en.lower()}）", m.end()):  # the text glosses it itself
                    self.seen.add(term.en)
                continue  # another parenthesis follows: "抢占（preemption）（FCFS ……）" reads badly, gloss a later use
            self.seen.add(term.en)
            out.append(text[last:m.end()] + f"（{term.en}）")
            last = m.end()
        return "".join(out) + text[last:]
