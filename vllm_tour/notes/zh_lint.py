"""`vllm-tour annotations lint`: the Chinese texts against a small glossary and the rules of Chinese punctuation.

The glossary keeps apart words a learner must not confuse: the null block (block 0, a placeholder that
holds no KV) is 占位块, a free block is 空闲块, a block never used since start is 未使用的块; "空块" could
be any of them, so it is never used. The KV pool lives in host memory on the CPU pin: it is the KV 缓存池,
and 显存 (GPU memory) is said only where the note's English text is about a GPU.

Punctuation: no ASCII space beside a fullwidth mark (the loader already joins wrapped lines there without one,
see `annotations.join_cjk_lines`), and no half-width `,` `;` `:` between Chinese characters. Code spans are
not checked: they hold upstream code, not Chinese.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_tour.notes.annotations import CJK, Subsystem

_CJK_PUNCT = "，。；：、！？（）「」『』《》【】"
_CODE_SPAN = re.compile(r"`[^`]*`")
_SPACED_PUNCT = re.compile(f" +[{_CJK_PUNCT}]|[{_CJK_PUNCT}] +")
_HALF_WIDTH_BETWEEN = re.compile(f"[{CJK}][,;:] ?[{CJK}]")
_ABOUT_GPU = re.compile(r"\b(GPU|CUDA|HBM|VRAM|device memory)", re.IGNORECASE)


@dataclass(frozen=True)
class Term:
    wrong: re.Pattern
    advice: str
    allowed_when_en: re.Pattern | None = None  # the English text of the same note makes the word right


GLOSSARY = (
    Term(re.compile("空块"), "say 占位块 (the null block), 空闲块 (a free block) or 未使用的块 (a block never used)"),
    Term(re.compile(r"KV ?池|KV ?显存池"), "the KV pool is the KV 缓存池"),
    Term(re.compile("显存"), "the note is not about GPU memory: say 内存, or KV 缓存池 for the KV pool",
         allowed_when_en=_ABOUT_GPU),
)


def problems_in(zh: str, en: str) -> list[str]:
    """What is wrong with one Chinese text; `en` is the same note's English text."""
    text = _CODE_SPAN.sub("`…`", zh)  # code elided: it is not Chinese
    out = []
    for term in GLOSSARY:
        for m in term.wrong.finditer(text):
            if term.allowed_when_en is None or not term.allowed_when_en.search(en):
                out.append(f'"{m.group()}" in "{_around(text, m)}": {term.advice}')
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
