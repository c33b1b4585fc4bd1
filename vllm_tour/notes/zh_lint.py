"""`vllm-tour annotations lint`: the Chinese texts against the glossary and the rules of Chinese punctuation.

The glossary (annotations/glossary/terms.toml, notes/glossary.py) gives each term one Chinese rendering and
lists the others a text must not use: it keeps apart words a learner must not confuse (the null block, block 0
holding no KV, is 占位块; a free block is 空闲块; "空块" could be either, so it is never used) and makes a term
read the same on every page (prefill is 预填充 everywhere, not "prefill" on one page and 预填 on another).
One rule depends on the note: 显存 (GPU memory) is said only where the note's English text is about a GPU;
the KV pool in host memory on the CPU pin is the KV 缓存池.

Punctuation: no ASCII space beside a fullwidth mark (the loader already joins wrapped lines there without one,
see `annotations.join_cjk_lines`), and no half-width `,` `;` `:` between Chinese characters. Code spans are
not checked: they hold upstream code, not Chinese.
"""

from __future__ import annotations

import re

from vllm_tour.notes.annotations import CJK, Subsystem
from vllm_tour.notes.glossary import misrenderings

_CJK_PUNCT = "，。；：、！？（）「」『』《》【】"
_CODE_SPAN = re.compile(r"`[^`]*`")
_SPACED_PUNCT = re.compile(f" +[{_CJK_PUNCT}]|[{_CJK_PUNCT}] +")
_HALF_WIDTH_BETWEEN = re.compile(f"[{CJK}][,;:] ?[{CJK}]")
_ABOUT_GPU = re.compile(r"\b(GPU|CUDA|HBM|VRAM|device memory)", re.IGNORECASE)
_VRAM = re.compile("显存")
_VRAM_ADVICE = "the note is not about GPU memory: say 内存, or KV 缓存池 for the KV pool"


def problems_in(zh: str, en: str) -> list[str]:
    """What is wrong with one Chinese text; `en` is the same note's English text."""
    text = _CODE_SPAN.sub("`…`", zh)  # code elided: it is not Chinese
    out = [f'"{m.group()}" in "{_around(searched, m)}": the glossary renders {term.en!r} as {term.zh}'
           for term, m, searched in misrenderings(zh)]
    if not _ABOUT_GPU.search(en):
        out += [f'"{m.group()}" in "{_around(text, m)}": {_VRAM_ADVICE}' for m in _VRAM.finditer(text)]
    for m in _SPACED_PUNCT.finditer(text):
        out.append(f'space beside fullwidth punctuation in "{_around(text, m)}"')
    for m in _HALF_WIDTH_BETWEEN.finditer(text):
        out.append(f'half-width "{m.group()[1]}" between Chinese characters in "{_around(text, m)}": use its fullwidth form')
    return out


def lint(subs: list[Subsystem]) -> list[str]:
    """`where: problem` lines for every Chinese text (subsystem title and intro, notes, their variants)."""
    lines = []
    for s in subs:
        for part in ("title", "intro"):
            lines += [f"{s.name} ({part}): {p}" for p in problems_in(getattr(s, part)["zh"], getattr(s, part)["en"])]
        for n in s.notes:
            lines += [f"{n.id}: {p}" for p in problems_in(n.zh, n.en)]
            for pin, v in n.variant.items():
                lines += [f"{n.id} ({pin}): {p}" for p in problems_in(v.zh, v.en)]
    return lines


def _around(text: str, m: re.Match, width: int = 8) -> str:
    return text[max(0, m.start() - width): m.end() + width].replace("\n", " ")
