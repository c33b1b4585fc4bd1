"""The site's trace pages: the golden traces of the site's pin, step by step, each event linked to the notes on
the code that made it (trace/event_notes.py), and the proven notes linked to the run that proves them.

A golden trace is a real upstream run checked in (traces/golden/<name>/ for the CPU pin, traces/golden/<pin>/...
for others): the site shows what happened, the notes why.
"""

from __future__ import annotations

from pathlib import Path

from vllm_tour.notes.concepts import CONCEPTS
from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.site.explain import explain_section
from vllm_tour.site.markup import both, esc
from vllm_tour.trace.reader import Run, load_run
from vllm_tour.views.event_notes import notes_by_concept, step_events

HEADERS = ({"en": "step", "zh": "步"}, {"en": "batch (request×tokens)", "zh": "批次（请求×token）"},
           {"en": "events → notes", "zh": "事件 → 注解"}, {"en": "free blocks", "zh": "空闲块"})


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


def trace_page(run: Run, pin: str, note_href) -> tuple[str, str]:
    """(title, body) of one trace's page; note_href(note id) -> the link to a note in the site."""
    by_concept = notes_by_concept(pin)
    rows = []
    for step in run.steps:
        s = step.scheduler
        batch = " ".join(f"{r.req_id}×{r.num_scheduled_tokens}" for r in s.scheduled) if s else ""
        cells = []
        for text, concept in step_events(step):
            notes = by_concept.get(concept, [])
            link = (f' <a class="internal" href="{esc(note_href(notes[0][0]))}" title="{esc(CONCEPTS[concept][1])}">'
                    f'<code>{esc(notes[0][0])}</code></a>') if notes else ""
            cells.append(f'<span class="ev ev-{concept}">{esc(text)}</span>{link}')
        free = f"{step.kv.free_blocks}/{step.kv.num_blocks}" if step.kv else ""
        rows.append(f'<tr id="step-{step.index}"><td>{step.index}</td><td><code>{esc(batch)}</code></td>'
                    f'<td>{"<br>".join(cells)}</td><td>{free}</td></tr>')
    meta = run.meta
    reqs = "; ".join(f"{r.req_id}: {len(r.prompt_token_ids or [])} prompt tokens, max {r.max_tokens}" for r in meta.requests)
    body = (f'<p class="muted">{esc(meta.model)} · pin {esc(meta.pin)} · {len(run.steps)} steps · {esc(reqs)} · '
            f'<code>vllm-tour show {esc(run.path.name)}</code></p>'
            f'<table class="concepts trace"><tr>{"".join(f"<th>{both(h)}</th>" for h in HEADERS)}</tr>{"".join(rows)}</table>'
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
