"""The site's escaping and bilingual markup: every page writes its text through these two."""

from __future__ import annotations

import html

from markdown_it import MarkdownIt

from vllm_tour.notes.annotations import LANGS

_MD = MarkdownIt("commonmark", {"html": False})


def esc(s: str) -> str:
    return html.escape(s, quote=True)


def both(texts: dict[str, str], tag: str = "span", md: bool = False, cls: str = "") -> str:
    """One element per language; the page's switch shows one of them."""
    out = []
    for lang in LANGS:
        body = _MD.render(texts[lang]) if md else esc(texts[lang])
        out.append(f'<{tag} class="i18n {cls}" lang="{lang}">{body}</{tag}>')
    return "".join(out)
