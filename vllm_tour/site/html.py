"""`vllm-tour site`: static HTML of the annotated request path. No server: open index.html.

index.html follows the request journey (subsystems in `order`), then maps trace
concepts (preemption, prefix hit, ...) to the notes on the code that does them.
One page per annotated symbol: code on the left, notes beside the lines they
anchor on the right. Both languages are in every page; a switch (remembered in
localStorage and carried in links as ?lang=) shows one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from vllm_tour.notes.annotations import LANGS, Subsystem, all_notes, caution_text
from vllm_tour.notes.checked import load_checked
from vllm_tour.notes.concepts import CONCEPTS
from vllm_tour.notes.glossary import FirstUse, load_glossary
from vllm_tour.notes.locate import Placement, locate
from vllm_tour.notes.resolve import NotFound, SourceTree
from vllm_tour.site.markup import both, esc

_UI = {
    "en": {"journey": "The request journey", "concepts": "From a trace to the code", "notes": "notes", "note": "note",
           "field": "trace field", "code": "code", "back": "← index", "orphan": "does not resolve on this pin",
           "whole": "on the whole symbol", "probes": "probes", "see": "see", "prev": "previous", "next": "next",
           "on_page": "Notes on this page", "folded": "lines without notes", "loop": "One engine step",
           "proven": "proven on a live run of", "traces": "Traces, step by step",
           "repros": "Reproduced upstream issues", "repros_page": "The repro library: verdict per pin, notes on the code",
           "glossary": "Glossary", "glossary_page": "The terms the notes use, and their one Chinese rendering",
           "term": "term", "rendering": "Chinese", "meaning": "meaning", "not": "never written",
           "checked_on": "checked against", "own_text": "its own text", "not_on": "not on"},
    "zh": {"journey": "请求的旅程", "concepts": "从 trace 到代码", "notes": "条注解", "note": "条注解", "field": "trace 字段",
           "code": "代码", "back": "← 目录", "orphan": "在此 pin 上无法定位", "whole": "针对整个符号",
           "probes": "探针", "see": "参见", "prev": "上一页", "next": "下一页",
           "on_page": "本页注解", "folded": "行无注解的代码", "loop": "引擎的一步",
           "proven": "已在真实运行中验证：", "traces": "逐步查看 trace",
           "repros": "复现的上游问题", "repros_page": "复现库：各 pin 的结论与相关代码的注解",
           "glossary": "术语表", "glossary_page": "注解所用的术语及其唯一的中文译法",
           "term": "术语", "rendering": "中文", "meaning": "含义", "not": "不写作",
           "checked_on": "核对过的版本", "own_text": "有专门的文本", "not_on": "不适用于"},
}

_CSS = """
:root { --bg:#fdfdfb; --fg:#1d1d1f; --muted:#6b6b70; --hl:#fff3c4; --card:#ffffff; --line:#e4e4e0; --acc:#b04a00; }
* { box-sizing: border-box; }
body { margin:0; font: 15px/1.55 system-ui, -apple-system, "Segoe UI", "Noto Sans CJK SC", "PingFang SC", sans-serif;
       background:var(--bg); color:var(--fg); }
header { position:sticky; top:0; z-index:2; background:#23201c; color:#f5f1ea; padding:.6rem 1.2rem;
         display:flex; gap:1rem; align-items:center; flex-wrap:wrap; }
header a { color:#ffcf8a; } header .pin { color:#bdb6aa; font-size:.85rem; }
header h1 { font-size:1.05rem; margin:0; font-family: ui-monospace, Menlo, Consolas, monospace; word-break:break-all; }
.switch { margin-left:auto; display:flex; gap:.3rem; }
.switch button { border:1px solid #6d655a; background:transparent; color:#f5f1ea; padding:.2rem .7rem; border-radius:4px; cursor:pointer; }
.switch button[aria-pressed=true] { background:#ffcf8a; color:#23201c; }
main { padding: 1rem 1.2rem 4rem; max-width: 1500px; margin: 0 auto; }
html[data-lang=en] [lang=zh].i18n, html[data-lang=zh] [lang=en].i18n { display:none; }
.row { display:grid; grid-template-columns: minmax(0, 1.35fr) minmax(0, 1fr); gap: 1rem; border-top:1px dashed var(--line); }
.row.plain { border-top: none; }
pre.code { margin:0; padding:.3rem 0; overflow-x:auto; font: 12.5px/1.5 ui-monospace, Menlo, Consolas, monospace; }
.line { display:block; white-space:pre; padding-right:.5rem; }
.line.hl { background: var(--hl); box-shadow: inset 3px 0 0 var(--acc); }
.ln { display:inline-block; width:3.2em; color:#a4a4a0; text-align:right; margin-right:.8em; user-select:none; }
.notes { padding:.3rem 0; }
.note { background:var(--card); border:1px solid var(--line); border-left:4px solid var(--acc); border-radius:6px;
        padding:.5rem .8rem; margin:.3rem 0 .7rem; }
.note:target { outline: 2px solid var(--acc); }
.note.orphan { border-left-color:#c00; }
.note .head { font-size:.78rem; color:var(--muted); font-family: ui-monospace, Menlo, monospace; }
.note .body p { margin:.35rem 0; }
.note code, li code, table.repros td div code { background:#f1efe8; padding:0 .25em; border-radius:3px; font-size:.9em; }
.tags { font-size:.8rem; color:var(--muted); margin-top:.3rem; }
.tags a { margin-right:.5em; }
.proven { color:#1d6b2f; font-weight:600; }
table.trace td:first-child { color: var(--muted); width: 3em; } .ev-preemption { color:#b00; font-weight:600; }
.ev-prefix-hit { color:#1d6b2f; } .ev-eviction { color:#8a5a00; } .ev-finish { color:#1f4e8a; font-weight:600; }
ul.jumps { margin:.4rem 0 .8rem; padding-left:1.2rem; } ul.jumps a { white-space:nowrap; }
tr.folded > td { padding:0; } tr.folded table.trace { margin:0; background:#faf9f5; }
details.steps > summary { cursor:pointer; color:var(--muted); padding:.35rem .5rem; background:#f4f3ef; }
details.blocks > summary { cursor:pointer; color:var(--muted); font-size:.85rem; }
table.repros td div p { margin:0 0 .3rem; }
table.grid { border-collapse:collapse; margin:.2rem 0; font: 12px ui-monospace, Menlo, monospace; }
table.grid th, table.grid td { border:1px solid var(--line); padding:.05rem .35rem; text-align:right; }
.own-0 { background:#d9f2f7; } .own-1 { background:#f7d9f2; } .own-2 { background:#dcf5d6; } .own-3 { background:#fbf0c8; }
.own-4 { background:#dbe3fb; } .own-5 { background:#fbdcd6; } .own-6 { background:#c9ece6; } .own-7 { background:#ecd6fb; }
.own-8 { background:#e8f5c4; } .own-9 { background:#f9e2c2; } .own-10 { background:#d2d9ea; } .own-11 { background:#f1d4dc; }
.sub { margin: 1.4rem 0; padding: .8rem 1rem; background:var(--card); border:1px solid var(--line); border-radius:8px; }
.sub h3 { margin:.1rem 0 .4rem; } .sub ul { margin:.3rem 0; }
.step { display:inline-block; min-width:1.8em; color:var(--acc); font-weight:700; }
table.concepts { border-collapse: collapse; width:100%; }
table.concepts td, table.concepts th { border-bottom:1px solid var(--line); padding:.4rem .5rem; text-align:left; vertical-align:top; }
table.concepts tr:target { background: var(--hl); }
.muted { color: var(--muted); }
.caution { color: #8a5a00; background: #fff6df; padding: .2rem .4rem; border-radius: 4px; margin: .2rem 0; }
details.fold { margin: 0; }
details.fold > summary { cursor: pointer; color: var(--muted); font: 12px ui-monospace, Menlo, monospace;
                         padding: .15rem 0 .15rem 4em; background: #f4f3ef; list-style: none; }
details.fold > summary::before { content: "▸ "; } details.fold[open] > summary::before { content: "▾ "; }
nav.pager { display:flex; justify-content:space-between; gap:1rem; margin: .8rem 0; font-size:.9rem; }
nav.pager a { max-width: 48%; overflow-wrap:anywhere; }
.toc { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:.4rem .9rem; margin:.6rem 0 1rem; }
.toc ol { margin:.2rem 0; padding-left:1.6rem; } .toc li { margin:.1rem 0; }
.loop { display:flex; flex-wrap:wrap; align-items:center; gap:.4rem; margin:.6rem 0 1.2rem; }
.loop a.box { border:1px solid var(--line); border-left:4px solid var(--acc); background:var(--card); border-radius:6px;
              padding:.35rem .6rem; text-decoration:none; color:var(--fg); }
.loop .arrow { color: var(--muted); }
@media (max-width: 900px) {
  .row { grid-template-columns: minmax(0, 1fr); }
  main { padding: .6rem .5rem 3rem; }
  nav.pager a { max-width: 100%; }
}
"""

_JS = """
(function () {
  var params = new URLSearchParams(location.search);
  var lang = params.get('lang');
  try { lang = lang || localStorage.getItem('vllm-tour-lang'); } catch (e) {}
  if (lang !== 'zh') lang = 'en';
  function apply(l) {
    document.documentElement.dataset.lang = l;
    document.documentElement.lang = l === 'zh' ? 'zh-CN' : 'en';
    try { localStorage.setItem('vllm-tour-lang', l); } catch (e) {}
    document.querySelectorAll('.switch button').forEach(function (b) {
      b.setAttribute('aria-pressed', String(b.dataset.lang === l));
    });
    // file:// pages may not share localStorage: carry the language in links
    document.querySelectorAll('a.internal').forEach(function (a) {
      var href = a.getAttribute('href'), hash = '';
      var i = href.indexOf('#'); if (i >= 0) { hash = href.slice(i); href = href.slice(0, i); }
      href = href.split('?')[0];
      a.setAttribute('href', href + '?lang=' + l + hash);
    });
  }
  document.addEventListener('DOMContentLoaded', function () {
    apply(lang);
    document.querySelectorAll('.switch button').forEach(function (b) {
      b.addEventListener('click', function () { apply(b.dataset.lang); });
    });
  });
  document.documentElement.dataset.lang = lang;
})();
"""


def page_name(qualname: str) -> str:
    return f"{qualname}.html"


def _ui(key: str, tag: str = "span") -> str:
    return both({lang: _UI[lang][key] for lang in LANGS}, tag)


def _page(title: str, head: str, body: str, root: str) -> str:
    switch = ('<div class="switch"><button type="button" data-lang="en" id="lang-en">English</button>'
              '<button type="button" data-lang="zh" id="lang-zh">中文</button></div>')
    return (f'<!doctype html>\n<html lang="en" data-lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{esc(title)}</title>'
            f'<link rel="stylesheet" href="{root}style.css"><link rel="stylesheet" href="{root}pygments.css">'
            f'<script src="{root}site.js"></script></head><body>'
            f'<header>{head}{switch}</header><main>{body}</main></body></html>\n')


class _Links:
    """Where a symbol or note id lives in the site (None: not annotated here)."""

    def __init__(self, subs: list[Subsystem], proofs: dict | None = None, traces: dict[str, str] | None = None):
        self.symbols = {s for sub in subs for s in sub.symbols()}
        self.notes = {n.id: n.symbol for n in all_notes(subs)}
        self.proofs = proofs or {}  # note id -> verify.Proof on this pin
        self.traces = traces or {}  # golden run name -> its trace page (from the site root)
        self.checked = load_checked()  # note id -> pin -> accepted digests: where a reviewer checked it

    def href(self, target: str, root: str) -> str | None:
        if target in self.notes:
            return f"{root}sym/{page_name(self.notes[target])}#note-{target}"
        if target in self.symbols:
            return f"{root}sym/{page_name(target)}"
        return None

    def link(self, target: str, root: str) -> str:
        h = self.href(target, root)
        short = ".".join(target.split(".")[-2:])  # Class.method reads better than the full path
        label = f"<code>{esc(short)}</code>"
        return f'<a class="internal" href="{esc(h)}" title="{esc(target)}">{label}</a>' if h else f"<code>{esc(target)}</code>"


def _version(tag: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", tag))


def _releases(n, accepted: dict) -> str:
    """The releases the note was checked against (its pins, its own texts, digests accepted in checked.json),
    newest first, and those it is marked not to apply to."""
    checked = sorted(set(n.pins) | set(n.variant) | set(accepted), key=_version, reverse=True)
    cells = [f"<code>{esc(t)}</code>" + (f" ({_ui('own_text')})" if t in n.variant else "") for t in checked]
    line = f'<span class="releases">{_ui("checked_on")}: {", ".join(cells)}'
    if n.not_on:
        line += f" · {_ui('not_on')}: " + ", ".join(f"<code>{esc(t)}</code>" for t in sorted(n.not_on, key=_version))
    return line + "</span>"


def _note_card(i: int, p: Placement, links: _Links, pin: str, gloss: FirstUse) -> str:
    n = p.note
    where = f"L{p.span.start}–{p.span.end}" if p.ok and n.anchor else _ui("whole")
    head = f"[{i}] {esc(n.id)} · {where}"
    tags = []
    if n.probes:
        tags.append(_ui("probes") + ": " + ", ".join(f"<code>{esc(x)}</code>" for x in n.probes))
    for c in n.concepts:
        _, en, zh = CONCEPTS[c]
        tags.append(f'<a class="internal concept" href="../index.html#concept-{c}">'
                    + both({"en": en, "zh": zh}) + "</a>")
    if n.see:
        tags.append(_ui("see") + ": " + " ".join(links.link(t, "../") for t in n.see))
    tags.append(_releases(n, links.checked.get(n.id, {})))
    proof = links.proofs.get(n.id)
    if proof:
        run = (f'<a class="internal" href="../{esc(links.traces[proof.scenario])}">{esc(proof.scenario)}</a>'
               if proof.scenario in links.traces else f"<code>{esc(proof.scenario)}</code>")
        tags.append(f'<span class="proven">✓ {_ui("proven")} {run}</span> <code>vllm-tour annotations verify --note '
                    f'{esc(n.id)}</code>: ' + both({lang: proof.claim[lang] for lang in LANGS}))
    orphan = f'<div class="muted">⚠ {_ui("orphan")}: {esc(p.problem)}</div>' if not p.ok else ""
    if n.caution:
        orphan += '<div class="caution">⚠ ' + both({lang: caution_text(n, lang, pin) for lang in LANGS}) + "</div>"
    return (f'<div class="note{" orphan" if not p.ok else ""}" id="note-{esc(n.id)}"><div class="head">{head}</div>'
            f'{orphan}{both({"en": n.en, "zh": gloss(n.zh)}, "div", md=True, cls="body")}'
            f'<div class="tags">{" · ".join(tags)}</div></div>')


def _code_lines(code: str, start: int, hl: set[int]) -> list[str]:
    out = highlight(code, PythonLexer(), HtmlFormatter(nowrap=True)).split("\n")
    lines = []
    for k, src in enumerate(out[: code.count("\n") + (0 if code.endswith("\n") else 1)]):
        ln = start + k
        cls = "line hl" if ln in hl else "line"
        lines.append(f'<span class="{cls}" id="L{ln}"><span class="ln">{ln}</span>{src}</span>')
    return lines


CONTEXT = 3  # lines kept visible around a note's anchored lines
FOLD_MIN = 8  # a shorter run of unannotated lines stays visible: folding it would hide less than it costs
FOLD_SYMBOLS_OVER = 80  # lines; a shorter function is read whole


def _fold(lines: list[str], first: int, keep: set[int]) -> str:
    """The row's code, runs of at least FOLD_MIN lines outside `keep` folded into <details> (off the path the notes
    follow: KV connectors, Mamba, speculative decoding...)."""
    out, run = [], []

    def flush():
        if len(run) >= FOLD_MIN:
            label = f"L{first + run[0]}–{first + run[-1]} · {len(run)} "
            out.append(f'<details class="fold"><summary>{esc(label)}{_ui("folded")}</summary>'
                       f'<pre class="code">{"".join(lines[k] for k in run)}</pre></details>')
        elif run:
            out.append(f'<pre class="code">{"".join(lines[k] for k in run)}</pre>')
        run.clear()

    shown: list[int] = []
    for k in range(len(lines)):
        if first + k in keep:
            flush()
            shown.append(k)
        else:
            if shown:
                out.append(f'<pre class="code">{"".join(lines[j] for j in shown)}</pre>')
                shown.clear()
            run.append(k)
    if shown:
        out.append(f'<pre class="code">{"".join(lines[j] for j in shown)}</pre>')
    flush()
    return "".join(out)


def journey(subs: list[Subsystem]) -> list[str]:
    """Every annotated symbol once, in the order of the request journey (the site's previous/next)."""
    return list(dict.fromkeys(q for sub in subs for q in sub.symbols()))


def _pager(qualname: str, order: list[str]) -> str:
    i = order.index(qualname)
    prev = (f'<a class="internal prev" href="{esc(page_name(order[i - 1]))}">← {_ui("prev")}: '
            f'<code>{esc(".".join(order[i - 1].split(".")[-2:]))}</code></a>') if i > 0 else "<span></span>"
    nxt = (f'<a class="internal next" href="{esc(page_name(order[i + 1]))}">{_ui("next")}: '
           f'<code>{esc(".".join(order[i + 1].split(".")[-2:]))}</code> →</a>') if i + 1 < len(order) else "<span></span>"
    return f'<nav class="pager">{prev}{nxt}</nav>'


def _toc(numbered: list[tuple[int, Placement]]) -> str:
    items = []
    for i, p in numbered:
        first = {lang: re.sub(r"[`*]", "", p.note.text(lang).split("\n\n")[0]).replace("\n", " ") for lang in LANGS}
        short = {lang: (t[:110] + "…") if len(t) > 110 else t for lang, t in first.items()}
        items.append(f'<li><a class="internal" href="#note-{esc(p.note.id)}"><code>{esc(p.note.id)}</code></a> '
                     f'{both(short)}</li>')
    return f'<div class="toc">{_ui("on_page", "strong")}<ol>{"".join(items)}</ol></div>'


def symbol_page(tree: SourceTree, qualname: str, sub: Subsystem, pin: str, links: _Links,
                all_subs: list[Subsystem]) -> str:
    notes = [n for n in all_notes(all_subs) if n.symbol == qualname]
    try:
        symbol = tree.resolve(qualname)
    except NotFound as e:
        gloss = FirstUse()
        cards = "".join(_note_card(i, Placement(n, None, None, problem=e.why), links, pin, gloss)
                        for i, n in enumerate(notes, 1))
        return _page(qualname, f'<a class="internal" href="../index.html">{_ui("back")}</a><h1>{esc(qualname)}</h1>',
                     f'<div class="notes">{cards}</div>', "../")
    places = [locate(n, tree, symbol) for n in notes]
    # numbered in reading order (notes on the whole symbol first, then down the code), whichever files they come from
    places.sort(key=lambda p: (p.span.start, p.span.end) if p.ok and p.note.anchor else (0, 0))
    numbered = list(enumerate(places, 1))
    inline = [(i, p) for i, p in numbered if p.ok and p.note.anchor]
    top = [(i, p) for i, p in numbered if not (p.ok and p.note.anchor)]
    hl = {ln for _, p in inline for ln in range(p.span.start, p.span.end + 1)}
    lines = _code_lines(symbol.code, symbol.span.start, hl)
    # Rows start where a note's anchor starts; a row's notes sit beside its first lines.
    starts = sorted({symbol.span.start} | {p.span.start for _, p in inline})
    rows = []
    gloss = FirstUse()  # each glossary term's first use on the page gets its English
    for k, s in enumerate(starts):
        e = starts[k + 1] - 1 if k + 1 < len(starts) else symbol.span.end
        cards = [(i, p) for i, p in inline if p.span.start == s]
        if s == symbol.span.start:
            cards = top + cards
        # visible: the row's first lines (a signature, the anchor) and each anchored span with some context
        keep = set(range(s, s + CONTEXT)) | {ln for _, p in cards if p.ok and p.note.anchor
                                            for ln in range(p.span.start - CONTEXT, p.span.end + CONTEXT + 1)}
        if symbol.span.end - symbol.span.start < FOLD_SYMBOLS_OVER:
            keep = set(range(s, e + 1))
        code = _fold(lines[s - symbol.span.start : e - symbol.span.start + 1], s, keep)
        notes_html = "".join(_note_card(i, p, links, pin, gloss) for i, p in cards)
        rows.append(f'<div class="row{"" if cards else " plain"}"><div class="codecol">{code}</div>'
                    f'<div class="notes">{notes_html}</div></div>')
    rel = symbol.path.relative_to(tree.root.parent).as_posix()
    head = (f'<a class="internal" href="../index.html">{_ui("back")}</a><h1>{esc(qualname)}</h1>'
            f'<span class="pin">{esc(rel)}:{symbol.span.start}-{symbol.span.end} · pin {esc(pin)} · '
            f'{both(sub.title)}</span>')
    pager = _pager(qualname, journey(all_subs))
    return _page(qualname, head, pager + _toc(numbered) + "".join(rows) + pager, "../")


# One engine step, as the journey's chapters meet it: (title en, title zh, symbol linked)
LOOP = (
    ("add_request", "add_request", "vllm.v1.engine.core.EngineCore.add_request"),
    ("schedule: who runs, how many tokens", "schedule：谁运行、多少 token", "vllm.v1.core.sched.scheduler.Scheduler.schedule"),
    ("allocate KV blocks", "分配 KV 块", "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"),
    ("execute_model: inputs, the forward pass", "execute_model：准备输入、前向计算", "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model"),
    ("sample", "采样", "vllm.v1.sample.sampler.Sampler.forward"),
    ("update_from_output: finish, free", "update_from_output：结束与释放", "vllm.v1.core.sched.scheduler.Scheduler.update_from_output"),
)


def _loop(links: _Links) -> str:
    boxes = []
    for en, zh, q in LOOP:
        href = links.href(q, "")
        if href:
            boxes.append(f'<a class="internal box" href="{esc(href)}">{both({"en": en, "zh": zh})}</a>')
    return (f'<h2 id="loop">{_ui("loop")}</h2><div class="loop">' + '<span class="arrow">→</span>'.join(boxes)
            + '<span class="arrow">↺</span></div>')


def index_page(subs: list[Subsystem], pin: str, links: _Links) -> str:
    parts = [_loop(links), f'<h2>{_ui("journey")}</h2>']
    gloss = FirstUse()
    for k, sub in enumerate(subs, 1):
        items = []
        for q in sub.symbols():
            n = sum(1 for x in sub.notes if x.symbol == q)
            items.append(f'<li><a class="internal sym" href="sym/{esc(page_name(q))}"><code>{esc(q)}</code></a> '
                         f'<span class="muted">{n} {_ui("notes") if n > 1 else _ui("note")}</span></li>')
        parts.append(f'<section class="sub" id="sub-{esc(sub.name)}"><h3><span class="step">{k}</span>'
                     f'{both(sub.title)}</h3>{both({"en": sub.intro["en"], "zh": gloss(sub.intro["zh"])}, "div", md=True)}<ul>{"".join(items)}</ul></section>')
    parts.append(f'<h2 id="concepts">{_ui("concepts")}</h2><table class="concepts"><tr><th></th>'
                 f'<th>{_ui("field")}</th><th>{_ui("code")}</th></tr>')
    notes = all_notes(subs)
    for c, (field, en, zh) in CONCEPTS.items():
        refs = [f'<a class="internal" href="{esc(links.href(n.id, ""))}"><code>{esc(n.id)}</code></a>'
                for n in notes if c in n.concepts]
        parts.append(f'<tr id="concept-{c}"><td>{both({"en": en, "zh": zh})}</td><td><code>{esc(field)}</code></td>'
                     f'<td>{" ".join(refs) or "—"}</td></tr>')
    parts.append("</table>")
    if links.traces:
        items = "".join(f'<li><a class="internal" href="{esc(h)}">{esc(name)}</a></li>' for name, h in links.traces.items())
        parts.append(f'<h2 id="traces">{_ui("traces")}</h2><ul>{items}</ul>')
    parts.append(f'<h2 id="repros">{_ui("repros")}</h2><p><a class="internal" href="repros.html">{_ui("repros_page")}</a></p>')
    parts.append(f'<h2 id="glossary">{_ui("glossary")}</h2><p><a class="internal" href="glossary.html">{_ui("glossary_page")}</a></p>')
    head = (f'<h1>vllm-tour</h1><span class="pin">pin {esc(pin)} · {len(notes)} '
            f'{_ui("notes")}</span>')
    return _page(f"vllm-tour — pin {pin}", head, "".join(parts), "")


def glossary_body() -> str:
    """The glossary as a table: each term, its one Chinese rendering, the renderings the lint refuses, its meaning."""
    rows = []
    for t in sorted(load_glossary(), key=lambda t: t.en.lower()):
        avoid = "、".join(esc(a) for a in t.avoid) or "—"
        rows.append(f'<tr id="term-{esc(t.en.replace(" ", "-"))}"><td>{esc(t.en)}</td><td lang="zh">{esc(t.zh)}</td>'
                    f'<td>{both({"en": t.en_def, "zh": t.zh_def})}</td><td>{avoid}</td></tr>')
    head = "".join(f"<th>{_ui(k)}</th>" for k in ("term", "rendering", "meaning", "not"))
    return f'<table class="concepts glossary"><tr>{head}</tr>{"".join(rows)}</table>'


def write_site(out: Path, tree: SourceTree, subs: list[Subsystem], pin: str, status=lambda msg: None) -> Path:
    """`status` hears each phase (the command prints it on stderr: a build takes tens of seconds)."""
    out = Path(out)
    if (out / "sym").exists():
        shutil.rmtree(out / "sym")  # pages of symbols no longer annotated must not linger
    (out / "sym").mkdir(parents=True, exist_ok=True)
    from vllm_tour.notes.verify import proofs_for_pin
    from vllm_tour.site.traces import write_trace_pages

    status(f"site: reading the notes' proofs on pin {pin}")
    links = _Links(subs, proofs_for_pin(pin))
    status("site: the golden traces' pages")
    back = f'<a class="internal" href="../index.html">{_ui("back")}</a>'
    links.traces = dict(write_trace_pages(out, pin, lambda nid: links.href(nid, ""),
                                          lambda title, body: _page(title, f"{back}<h1>{esc(title)}</h1>", body, "../")))
    (out / "style.css").write_text(_CSS, encoding="utf-8")
    (out / "pygments.css").write_text(HtmlFormatter(style="friendly").get_style_defs(".code"), encoding="utf-8")
    (out / "site.js").write_text(_JS, encoding="utf-8")
    done = set()
    status(f"site: {sum(len(set(sub.symbols())) for sub in subs)} source pages")
    for sub in subs:
        for q in sub.symbols():
            if q in done:
                continue
            done.add(q)
            (out / "sym" / page_name(q)).write_text(symbol_page(tree, q, sub, pin, links, subs), encoding="utf-8")
    from vllm_tour.site.repros import repros_body

    status("site: the repro library and the index")

    (out / "repros.html").write_text(_page("vllm-tour — repros", f'<a class="internal" href="index.html">{_ui("back")}</a>'
                                           f'<h1>{_ui("repros")}</h1>', repros_body(lambda nid: links.href(nid, "")), ""),
                                     encoding="utf-8")
    (out / "glossary.html").write_text(_page("vllm-tour — glossary", f'<a class="internal" href="index.html">{_ui("back")}</a>'
                                             f'<h1>{_ui("glossary")}</h1>', glossary_body(), ""), encoding="utf-8")
    index = out / "index.html"
    index.write_text(index_page(subs, pin, links), encoding="utf-8")
    return index
