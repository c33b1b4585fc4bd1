"""The site's trace pages: the golden traces of the site's pin, step by step, each event linked to the notes on
the code that made it (views/event_notes.py), and the proven notes linked to the run that proves them.

A golden trace is a real upstream run checked in (traces/golden/<name>/ for the CPU pin, traces/golden/<pin>/...
for others): the site shows what happened, the notes why. A page reads like a lesson: links at the top to the
steps where something happens, runs of steps where nothing does folded into one line, and each step's block
tables one click away, drawn as `vllm-tour show --step N` draws them.
"""

from __future__ import annotations

from pathlib import Path

from vllm_tour.notes.concepts import CONCEPTS
from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.site.explain import explain_section
from vllm_tour.site.markup import both, esc
from vllm_tour.trace.reader import Run, Step, load_run
from vllm_tour.views.event_notes import Event, notes_by_concept, step_events
from vllm_tour.views.show import block_rows, last_steps

HEADERS = ({"en": "step", "zh": "步"}, {"en": "batch (request×tokens)", "zh": "批次（请求×token）"},
           {"en": "events → notes", "zh": "事件 → 注解"}, {"en": "free blocks", "zh": "空闲块"},
           {"en": "block tables", "zh": "块表"})
FOLD_FROM = 3  # quiet steps in a row with the same batch fold into one line from this many
JUMPS = ("preemption", "prefix-hit", "eviction", "finish")  # the events the top of the page links to
FINISH = {"en": "Request finished", "zh": "请求结束"}
LEGEND = {"en": "Block tables (each step's ▸ blocks): a request's blocks in order; + new this step, * reused (prefix "
                "cache, or another request's block); colour: the request that first got the block.",
          "zh": "块表（每步的 ▸ 块表）：请求的各个块按顺序排列；+ 本步新分配，* 复用（前缀缓存，或其他请求的块）；"
                "颜色：最先得到该块的请求。"}
COLOURS = 12  # owner colours (.own-0 .. .own-11 in the site's CSS), reused past that many requests


def golden_runs(pin: str) -> list[Run]:
    """The finished single-device golden runs recorded on `pin` (TP runs are shown by `vllm-tour show`)."""
    roots = [GOLDEN_DIR, GOLDEN_DIR / pin, GOLDEN_DIR / "proofs" / pin]  # the last: the runs notes are proven on
    runs = []
    for root in roots:
        for d in sorted(p for p in root.glob("*") if (p / "meta.json").is_file()):
            run = load_run(d)
            if run.finished and run.meta.pin == pin and (run.meta.engine_args or {}).get("tensor_parallel_size", 1) == 1:
                runs.append(run)
    return runs


def trace_page_name(run: Run) -> str:
    return f"{run.path.name}.html"


def page_events(run: Run) -> dict[int, list[Event]]:
    """Step index -> its events, each request's finish among them (in the step that computed its last token)."""
    finishing = last_steps(run)
    out = {}
    for step in run.steps:
        done = [Event(f"finish {f}", f"结束 {f}", "finish", f.split(" ")[0]) for f in finishing.get(step.index, [])]
        out[step.index] = step_events(step) + done
    return out


def _batch(step: Step) -> str:
    s = step.scheduler
    return " ".join(f"{r.req_id}×{r.num_scheduled_tokens}" for r in s.scheduled) if s else ""


def _quiet(step: Step, events: list[Event]) -> bool:
    """Nothing happened but the batch's tokens: no event, no block given or freed."""
    return not events and not (step.kv and (step.kv.allocated or step.kv.freed))


def folds(run: Run, events: dict[int, list[Event]]) -> list[list[Step]]:
    """The run's steps in groups: a run of FOLD_FROM or more quiet steps with the same batch is one group, every
    other step a group of its own."""
    groups: list[list[Step]] = []
    for step in run.steps:
        last = groups[-1] if groups else None
        if (last and _quiet(step, events[step.index]) and _quiet(last[-1], events[last[-1].index])
                and _batch(step) == _batch(last[-1])):
            last.append(step)
        else:
            groups.append([step])
    return [g for group in groups for g in ([group] if len(group) >= FOLD_FROM else [[s] for s in group])]


def _grid(run: Run, step: Step, colour: dict[str, int]) -> str:
    rows = block_rows(run, step)
    if not rows:
        return ""
    body = "".join(f'<tr><th class="own-{colour.get(rid, 0)}">{esc(rid)}</th>'
                   + "".join(f'<td class="own-{colour.get(owner, 0)}">{b}{mark}</td>' for b, mark, owner in cells)
                   + "</tr>" for rid, cells in rows)
    return f'<details class="blocks"><summary>{both(HEADERS[4])}</summary><table class="grid">{body}</table></details>'


def _row(run: Run, step: Step, events: list[Event], pin: str, note_href, colour: dict[str, int]) -> str:
    by_concept = notes_by_concept(pin)
    cells = []
    for e in events:
        notes = by_concept.get(e.concept, [])
        link = (f' <a class="internal" href="{esc(note_href(notes[0][0]))}" title="{esc(CONCEPTS[e.concept][1])}">'
                f'<code>{esc(notes[0][0])}</code></a>') if notes else ""
        cells.append(f'<span class="ev ev-{e.concept}">{both({"en": e.text, "zh": e.zh})}</span>{link}')
    cells += _block_moves(step)
    free = f"{step.kv.free_blocks}/{step.kv.num_blocks}" if step.kv else ""
    return (f'<tr id="step-{step.index}"><td>{step.index}</td><td><code>{esc(_batch(step))}</code></td>'
            f'<td>{"<br>".join(cells)}</td><td>{free}</td><td>{_grid(run, step, colour)}</td></tr>')


def _block_moves(step: Step) -> list[str]:
    """Blocks given and freed in the step, in grey: why a step with no event is not folded."""
    kv = step.kv
    if kv is None:
        return []
    given = " ".join(f"{rid} +{ids}" for rid, ids in kv.allocated.items() if ids)
    out = [both({"en": f"new blocks: {given}", "zh": f"新分配的块：{given}"})] if given else []
    if kv.freed:
        out.append(both({"en": f"freed {kv.freed}", "zh": f"释放 {kv.freed}"}))
    return [f'<span class="muted">{x}</span>' for x in out]


def _fold_line(group: list[Step]) -> dict[str, str]:
    first, last, batch = group[0].index, group[-1].index, _batch(group[0])
    s = group[0].scheduler
    phase = ("prefill", "预填充") if s and any(r.is_prefill for r in s.scheduled) else ("decode", "解码")
    return {"en": f"steps {first}–{last} ({len(group)}): {batch} {phase[0]} each, nothing else happened",
            "zh": f"第 {first}–{last} 步（共 {len(group)} 步）：每步 {batch} {phase[1]}，没有发生其他事"}


def _jumps(events: dict[int, list[Event]]) -> str:
    """One line per kind of event that happened: links to its steps."""
    lines = []
    for kind in JUMPS:
        hits = [(i, e) for i, evs in events.items() for e in evs if e.concept == kind]
        if not hits:
            continue
        title = FINISH if kind == "finish" else {"en": CONCEPTS[kind][1], "zh": CONCEPTS[kind][2]}
        links = " · ".join(f'<a href="#step-{i}">' + both({"en": f"step {i}" + (f" ({e.req_id})" if e.req_id else ""),
                                                             "zh": f"第 {i} 步" + (f"（{e.req_id}）" if e.req_id else "")})
                           + "</a>" for i, e in hits)
        lines.append(f'<li><span class="ev ev-{kind}">{both(title)}</span>: {links}</li>')
    return f'<ul class="jumps">{"".join(lines)}</ul>' if lines else ""


def _header(run: Run) -> str:
    meta = run.meta
    reqs_en = "; ".join(f"{r.req_id}: {len(r.prompt_token_ids or [])} prompt tokens, max {r.max_tokens}" for r in meta.requests)
    reqs_zh = "；".join(f"{r.req_id}：提示 {len(r.prompt_token_ids or [])} 个 token，最多生成 {r.max_tokens} 个"
                       for r in meta.requests)
    kv = next((s.kv for s in run.steps if s.kv), None)
    pool = ({"en": f" · KV pool {kv.num_blocks} blocks × {kv.block_size} tokens (+ null block 0)",
             "zh": f" · KV 缓存池 {kv.num_blocks} 个块 × 每块 {kv.block_size} 个 token（另有占位块 0）"}
            if kv else {"en": "", "zh": ""})
    line = {"en": f"{meta.model} · pin {meta.pin} · {len(run.steps)} steps{pool['en']} · {reqs_en}",
            "zh": f"{meta.model} · pin {meta.pin} · 共 {len(run.steps)} 步{pool['zh']} · {reqs_zh}"}
    return f'<p class="muted">{both(line)} · <code>vllm-tour show {esc(run.path.name)}</code></p>'


def trace_page(run: Run, pin: str, note_href) -> tuple[str, str]:
    """(title, body) of one trace's page; note_href(note id) -> the link to a note in the site."""
    events = page_events(run)
    colour = {rid: i % COLOURS for i, rid in enumerate(run.request_ids())}
    rows = []
    for group in folds(run, events):
        inner = "".join(_row(run, s, events[s.index], pin, note_href, colour) for s in group)
        if len(group) == 1:
            rows.append(inner)
        else:
            rows.append(f'<tr class="folded" id="steps-{group[0].index}-{group[-1].index}"><td colspan="{len(HEADERS)}">'
                        f'<details class="steps"><summary>{both(_fold_line(group))}</summary>'
                        f'<table class="concepts trace">{inner}</table></details></td></tr>')
    legend = f'<p class="muted">{both(LEGEND)}</p>' if any(s.kv for s in run.steps) else ""
    body = (_header(run) + _jumps(events) + legend
            + f'<table class="concepts trace"><tr>{"".join(f"<th>{both(h)}</th>" for h in HEADERS)}</tr>{"".join(rows)}</table>'
            + explain_section(run, note_href))
    return f"trace {run.path.name}", body


def write_trace_pages(out: Path, pin: str, note_href, page) -> list[tuple[str, str]]:
    """Write trace/<name>.html for each golden run of the pin; returns [(name, href from the site root)]."""
    (out / "trace").mkdir(parents=True, exist_ok=True)
    done = []
    for run in golden_runs(pin):
        title, body = trace_page(run, pin, lambda nid: "../" + note_href(nid))
        (out / "trace" / trace_page_name(run)).write_text(page(title, body), encoding="utf-8")
        done.append((run.path.name, f"trace/{trace_page_name(run)}"))
    return done
