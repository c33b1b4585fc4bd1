"""The site's "why" section of a trace page: each request's explanation in short (`vllm-tour explain RUN --request
R` gives the evidence), in both languages, each turn linked to the notes whose rule it applies."""

from __future__ import annotations

from vllm_tour.site.markup import both, esc
from vllm_tour.trace.reader import Run
from vllm_tour.views.explain import explain_requests, line_text, note_marks

TITLE = {"en": "Why: each request's turns", "zh": "为什么：每个请求的转折"}
INTRO = {
    "en": "From the records alone (vllm-tour explain {run} --request R prints each sentence with the record fields it "
          "read); each rule links to its note on the pinned source.",
    "zh": "只依据记录（vllm-tour explain {run} --request R 会给出每句话所依据的记录字段）；每条规则都链接到固定版本源码上的注解。",
}
RULES = {"en": "rules", "zh": "规则"}


def explain_section(run: Run, note_href) -> str:
    """The section's HTML ("" for a run without scheduler records); note_href(note id) -> the link to a note."""
    explained = explain_requests(run)
    if not explained:
        return ""
    holds = {nid for nid, mark in note_marks(run.meta.pin).items() if mark == ""}
    parts = [f'<section id="why"><h2>{both(TITLE)}</h2>',
             f'<p class="muted">{both({k: v.format(run=run.path.name) for k, v in INTRO.items()})}</p>']
    for rid, ex in explained.items():
        items = []
        for ln in ex.turns():
            # a note that does not hold on the run's pin is named, never linked as if it did
            notes = ", ".join(f'<a class="internal" href="{esc(note_href(n))}"><code>{esc(n)}</code></a>' if n in holds
                              else f"<code>{esc(n)}</code>" for n in ln.notes)
            rules = f' <span class="muted">{both(RULES)} {notes}</span>' if notes else ""
            items.append(f'<li data-cause="{esc(ln.cause or "")}">{both({lang: line_text(ln, lang) for lang in ("en", "zh")})}'
                         f"{rules}</li>")
        parts.append(f'<h3 id="why-{esc(rid)}"><code>{esc(rid)}</code></h3><ul>{"".join(items)}</ul>')
    return "".join(parts) + "</section>"
