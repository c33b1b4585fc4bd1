"""`vllm-tour show`: rich views of a run — the step table, one step in detail, one request's life."""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from vllm_tour.trace import levels
from vllm_tour.trace.experts import expert_view, moe_detail
from vllm_tour.trace.reader import Run, Step, load_run, parse_window, steps_between
from vllm_tour.views import spec_decode
from vllm_tour.views.event_notes import notes_line, step_concepts
from vllm_tour.views.explain import request_summary
from vllm_tour.views.served import engine_request

PROMPT_IDS_SHOWN = 16  # header: a prompt's first token ids
PROMPTS_SHOWN = 8  # header: requests whose prompt ids are listed
PROMPT_TEXT_SHOWN = 40  # header: characters of a prompt's text
PALETTE = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta", "bright_green", "bright_yellow", "bright_blue", "bright_red"]


# The words of `show --lang zh`: the step table, its events, the grid, the outputs and a request's view (the
# glossary's renderings, annotations/glossary/terms.toml). `--step N`'s detail stays English: its lines are the
# record fields by their names.
WORDS = {
    "en": {"steps": "{name} — {n} steps", "window": "{name} — steps {a}-{b} ({n} steps)",
           "one": "{name} — step {i} of {n}", "step": "step", "wait": "wait", "run": "run", "tokens": "tokens",
           "batch": "batch  (N new · R resumed · P prefill tokens · D decode)", "kv": "KV free (usable)",
           "events": "events", "PREEMPT": "PREEMPT", "finish": "finish", "ABORT": "ABORT", "hit": "hit",
           "evict": "evict", "grid": "block tables after step {i}'s allocation",
           "grid_caption": "+ new this step · * reused (prefix cache) · color: the block's first owner",
           "request": "request", "notes": "events in this run, and the notes on the code that makes them:",
           "outputs": "outputs", "prompt": "prompt", "generated": "generated", "text": "text",
           "blocks_per_step": "{rid}: blocks per step", "blocks_caption": "+ new · * prefix-cache hit", "blocks": "blocks",
           "why": "why (vllm-tour explain --request {rid} gives the evidence):",
           "io": "prompt {p} tokens → {g} generated ({f}): {ids}"},
    "zh": {"steps": "{name} — 共 {n} 步", "window": "{name} — 第 {a}-{b} 步（{n} 步）",
           "one": "{name} — 第 {i} 步（共 {n} 步）", "step": "步", "wait": "等待", "run": "运行", "tokens": "token",
           "batch": "批次（N 新请求 · R 恢复 · P 预填充 token 数 · D 解码）", "kv": "空闲 KV 块（可用）",
           "events": "事件", "PREEMPT": "抢占", "finish": "结束", "ABORT": "中止", "hit": "命中",
           "evict": "驱逐", "grid": "第 {i} 步分配之后的块表",
           "grid_caption": "+ 本步新分配 · * 前缀缓存复用 · 颜色：块的第一个持有者",
           "request": "请求", "notes": "本次运行中的事件，以及产生它们的代码上的注解：",
           "outputs": "输出", "prompt": "提示词", "generated": "生成", "text": "文本",
           "blocks_per_step": "{rid}：每一步的块", "blocks_caption": "+ 新分配 · * 前缀缓存命中", "blocks": "块",
           "why": "为什么（vllm-tour explain --request {rid} 给出证据）：",
           "io": "提示词 {p} 个 token → 生成 {g} 个（{f}）：{ids}"},
}
LANGS = tuple(WORDS)


def word(key: str, lang: str, **params) -> str:
    return WORDS[lang][key].format(**params)


def colors(run: Run) -> dict[str, str]:
    ids = run.request_ids()
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(ids)}


def block_owners(run: Run, upto: int | None = None) -> dict[int, str]:
    """Which request first got each block id (a block keeps its owner's color when others reuse it).

    A block freed and handed to someone else later gets the new owner.
    """
    owners: dict[int, str] = {}
    for s in run.steps:
        if upto is not None and s.index > upto:
            break
        if s.kv is None:
            continue
        for b in s.kv.freed:
            owners.pop(b, None)
        for rid, ids in s.kv.allocated.items():
            for b in ids:
                owners[b] = rid
        for rid, ids in s.kv.block_tables.items():
            for b in ids:
                owners.setdefault(b, rid)
    return owners


def _batch_cell(step: Step, col: dict[str, str], focus: str | None) -> Text:
    t = Text()
    if step.scheduler is None:
        return Text("(no scheduler record)", style="dim")
    for i, r in enumerate(step.scheduler.scheduled):
        if i:
            t.append(" ")
        mark = {"new": "N", "resumed": "R", "running": ""}[r.kind]
        what = f"P{r.num_scheduled_tokens}" if r.is_prefill else "D" if r.num_scheduled_tokens == 1 else f"D{r.num_scheduled_tokens}"
        style = col.get(r.req_id, "white") + (" bold underline" if r.req_id == focus else "")
        t.append(f"{r.req_id}:{mark}{what}", style=style)
    return t


def last_steps(run: Run) -> dict[int, list[str]]:
    """Step index -> requests whose last token was computed in that step (finished ones only)."""
    last: dict[str, int] = {}
    for s in run.steps:
        if s.scheduler:
            for r in s.scheduler.scheduled:
                last[r.req_id] = s.index
    done = {o.req_id: o.finish_reason for o in run.outputs.requests} if run.outputs else {}
    out: dict[int, list[str]] = {}
    for rid, idx in last.items():
        if rid in done:
            out.setdefault(idx, []).append(f"{rid} ({done[rid]})")
    return out


def window_last_steps(run: Run) -> dict[int, list[str]]:
    """last_steps for a window (Run.window) without the steps after it: a request scheduled in step s
    finished there when step s + 1 lists it as finished, or when s is the run's last step."""
    done = {o.req_id: o.finish_reason for o in run.outputs.requests} if run.outputs else {}
    steps = [*run.steps, run.next_step]
    out: dict[int, list[str]] = {}
    for s, after in zip(run.steps, steps[1:]):
        if s.scheduler is None:
            continue
        if after is None:  # the run's last step
            ended = done.keys()
        elif after.index == s.index + 1 and after.scheduler is not None:
            ended = after.scheduler.finished
        else:
            continue
        for r in s.scheduler.scheduled:
            if r.req_id in ended and r.req_id in done:
                out.setdefault(s.index, []).append(f"{r.req_id} ({done[r.req_id]})")
    return out


def _events_cell(step: Step, run: Run, finishing: list[str] = (), lang: str = "en") -> Text:
    w = WORDS[lang]
    t = Text()
    s = step.scheduler
    if s:
        for p in s.preempted:
            t.append(f"{w['PREEMPT']} {p.req_id} ", style="bold red")
    for f in finishing:
        t.append(f"{w['finish']} {f} ", style="bold")
    for a in step.aborts:
        t.append(f"{w['ABORT']} {a.req_id} ", style="bold magenta")
    if step.kv:
        for h in step.kv.prefix_hits:
            t.append(f"{w['hit']} {h.req_id}:{h.num_hit_tokens}t ", style="bold green")
        if step.kv.evicted:
            t.append(f"{w['evict']} {len(step.kv.evicted)} ", style="yellow")
    t.append(spec_decode.events(step))
    if step.errors:
        t.append(f"{len(step.errors)} probe error(s)", style="bold red")
    return t


def step_table(run: Run, focus: str | None = None, only: Step | None = None, lang: str = "en") -> Table:
    """Every step of the run (of its window), or `only` that one (its finishes still judged on the whole run)."""
    col = colors(run)
    name, n = run.path.name, len(run.steps)
    if only:
        title = word("one", lang, name=name, i=only.index, n=n)
    elif run.window:
        title = word("window", lang, name=name, a=run.window[0], b=run.window[1], n=n)
    else:
        title = word("steps", lang, name=name, n=n)
    title = escape(title)
    table = Table(title=title, title_justify="left", expand=False)
    blocks = levels.has(run.meta.level, "blocks")  # no KV column for a run that recorded none
    w = WORDS[lang]
    columns = [(w["step"], "right"), (w["wait"], "right"), (w["run"], "right"), (w["tokens"], "right"),
               (w["batch"], "left"), *([(w["kv"], "right")] if blocks else []), (w["events"], "left")]
    for c, j in columns:
        table.add_column(c, justify=j, overflow="fold")
    finishing = window_last_steps(run) if run.window else last_steps(run)
    for s in [only] if only else run.steps:
        if focus and not _involves(s, focus):
            continue
        sch, kv = s.scheduler, s.kv
        table.add_row(
            str(s.index),
            f"{sch.waiting_before}→{sch.waiting_after}" if sch else "",
            f"{sch.running_before}→{sch.running_after}" if sch else "",
            f"{sch.tokens_scheduled}/{sch.token_budget}" if sch else "",
            _batch_cell(s, col, focus),
            *([f"{kv.free_blocks}/{kv.num_blocks}" if kv else ""] if blocks else []),
            _events_cell(s, run, finishing.get(s.index, []), lang),
        )
    return table


def _involves(step: Step, rid: str) -> bool:
    s = step.scheduler
    if s and (any(r.req_id == rid for r in s.scheduled) or any(p.req_id == rid for p in s.preempted) or rid in s.finished):
        return True
    return bool(step.kv and rid in step.kv.block_tables)


def block_rows(run: Run, step: Step, only: str | None = None) -> list[tuple[str, list[tuple[int, str, str]]]]:
    """The step's block tables after its allocation, in request order: (request, [(block id, mark, the block's
    first owner)]); mark "+" new this step, "*" reused (a prefix-cache hit, or another request's block)."""
    owners = block_owners(run, step.index)
    kv = step.kv
    if kv is None:
        return []
    order = run.request_ids()
    hit_ids = {h.req_id: set(h.block_ids) for h in kv.prefix_hits}
    rows = []
    for rid in sorted((r for r in kv.block_tables if only is None or r == only),
                      key=lambda r: order.index(r) if r in order else len(order)):
        new = set(kv.allocated.get(rid, []))
        cells = [(b, "+" if b in new else "*" if b in hit_ids.get(rid, ()) or owners.get(b, rid) != rid else "",
                  owners.get(b, rid)) for b in kv.block_tables[rid]]
        rows.append((rid, cells))
    return rows


def block_grid(run: Run, step: Step, only: str | None = None, lang: str = "en") -> Table:
    """Requests × block slots at the end of the step's allocation."""
    col = colors(run)
    table = Table(
        title=word("grid", lang, i=step.index),
        caption=word("grid_caption", lang),
        title_justify="left",
        caption_justify="left",
        min_width=72,
    )
    table.add_column(word("request", lang))
    rows = block_rows(run, step, only)
    for i in range(max((len(cells) for _, cells in rows), default=0)):
        table.add_column(str(i), justify="right")
    for rid, cells in rows:
        table.add_row(Text(rid, style=col.get(rid, "white")),
                      *(Text(f"{b}{mark}", style=col.get(owner, "white")) for b, mark, owner in cells))
    return table


def step_detail(run: Run, step: Step) -> Group:
    parts = [step_table(run, only=step)]
    sch = step.scheduler
    if sch:
        t = Table(title=f"step {step.index}: scheduled", title_justify="left", min_width=60)
        for c in ("request", "kind", "tokens", "computed before", "prompt", "output", "phase"):
            t.add_column(c)
        for r in sch.scheduled:
            t.add_row(Text(r.req_id), r.kind, str(r.num_scheduled_tokens), str(r.num_computed_tokens), str(r.num_prompt_tokens), str(r.num_output_tokens), "prefill" if r.is_prefill else "decode")
        parts.append(t)
        for p in sch.preempted:
            body = Text.assemble(("preempted " + p.req_id, "bold red"), f": {p.reason}\nfreed blocks {p.freed_block_ids}; {p.num_computed_tokens_lost} computed tokens to recompute")
            parts.append(Panel(body, title="preemption", expand=False))
        if sch.finished:
            parts.append(Text(f"finished before this step (blocks freed now): {', '.join(sch.finished)}", style="dim"))
    for a in step.aborts:
        body = Text.assemble(("aborted " + a.req_id, "bold magenta"),
                             f" ({a.status_before}, {a.num_computed_tokens} computed tokens, {a.num_output_tokens} output): "
                             f"dropped after this step's schedule; blocks {a.block_ids}, freed {a.freed_block_ids} "
                             "(in the next step's KV record)")
        parts.append(Panel(body, title="abort", expand=False))
    if step.spec_verify or step.spec_proposal:
        parts.append(spec_decode.spec_table(run, step=step))
    parts += _not_recorded(run, "blocks", "block tables, KV pool, prefix-cache hits")
    if step.kv:
        parts.append(block_grid(run, step))
        kv = step.kv
        parts.append(Text(f"KV: {kv.free_blocks}/{kv.num_blocks} blocks free, usage {kv.usage:.1%}, freed {kv.freed or '-'}, evicted {kv.evicted or '-'}, prefix caching {'on' if kv.prefix_caching else 'off'}"))
        for h in kv.prefix_hits:
            parts.append(Text(f"prefix hit: {h.req_id} reuses blocks {h.block_ids} ({h.num_hit_tokens} tokens)", style="green"))
    parts += _not_recorded(run, "full", "model runner inputs, attention metadata")
    for rank, rr in sorted(step.runner.items()):
        t = Table(title=f"model runner (rank {rank})", title_justify="left", show_header=False)
        t.add_column("field", style="bold")
        t.add_column("value", overflow="fold")
        t.add_row("batch order", Text(" ".join(f"{r}×{n}" for r, n in zip(rr.req_ids, rr.num_scheduled_tokens))))
        for name in ("input_ids", "positions", "slot_mapping"):
            v = getattr(rr, name)
            t.add_row(name, str(v.full) if v.full is not None else f"{v.length} values: {v.head} … {v.tail} sha256 {v.sha256[:12]}")
        t.add_row("query_start_loc", str(rr.query_start_loc))
        t.add_row("seq_lens", str(rr.seq_lens))
        t.add_row("logits_indices", str(rr.logits_indices))
        t.add_row("sampled", Text(", ".join(f"{k}: {v}" for k, v in rr.sampled_token_ids.items())))
        parts.append(t)
    for rank, a in sorted(step.attention.items()):
        layers = "; ".join(f"{l.layer} {l.kv_cache_shape} {l.kv_cache_dtype}" for l in a.layers)
        shape = f" {a.num_layers} layers × {a.num_kv_heads} KV heads × head size {a.head_size}," if a.num_layers is not None else ""
        parts.append(Text(f"attention (rank {rank}): {a.backend}{shape} layout {a.layout}; seq_lens {a.seq_lens}; query_lens {a.query_lens}; block_table {a.block_table}; kv cache {layers}"))
    if step.collectives:
        parts.append(collectives_table(step))
    parts += moe_detail(step)
    caps = [c for c in step.captures if not c.name.startswith("tp.")]
    if caps:
        parts.append(Text("captures: " + ", ".join(f"{c.name} {c.shape} → {c.file}" for c in caps)))
    tp_files = sorted({c.file for c in step.captures if c.name.startswith("tp.")})
    if tp_files:
        parts.append(Text(f"TP tensors (tp.column_out.<layer>, tp.<op>_in/_out.<layer>) → {', '.join(tp_files)}"))
    for e in step.errors:
        parts.append(Text(f"probe error in {e.probe} ({e.target}): {e.error}", style="bold red"))
    lines = [line for c in step_concepts(step) if (line := notes_line(c, run.meta.pin))]
    if lines:
        parts.append(Text("read the code (vllm-tour source QUALNAME, or the site):\n  " + "\n  ".join(lines), style="dim"))
    return Group(*parts)


def collectives_table(step: Step) -> Table:
    """The step's TP collectives, ranks side by side: what each rank sent in and got back (sha256 prefixes)."""
    ranks = sorted(step.collectives)
    t = Table(title=f"step {step.index}: tensor-parallel collectives, per rank", title_justify="left",
              caption="in: this rank's partial sum / shard · out: the result · ranks must agree on out", caption_justify="left")
    for c in ("op", "layer", "shape in → out"):
        t.add_column(c)
    for r in ranks:
        t.add_column(f"rank {r} in / out")
    t.add_column("ranks agree")
    for calls in zip(*(step.collectives[r] for r in ranks)):
        c0 = calls[0]
        outs = {c.sha256_out for c in calls if c.sha256_out is not None}
        t.add_row(c0.op, c0.layer, f"{c0.shape_in} → {c0.shape_out}",
                  *(f"{c.sha256_in[:8]} / {(c.sha256_out or '-')[:8]}" for c in calls),
                  Text("yes", style="green") if len(outs) <= 1 else Text("NO", style="bold red"))
    return t


def tp_summary(run: Run) -> Text:
    """One line per rank: the weight shards it holds and the all-reduce path; whether ranks ever disagreed."""
    t = Text()
    for rank, rec in sorted(run.tp_shards.items()):
        sharded = sum(1 for s in rec.shards if any(s.name == o.name and s.sha256 != o.sha256
                                                   for r, other in run.tp_shards.items() if r != rank for o in other.shards))
        t.append(f"rank {rank}: {len(rec.shards)} weight tensors ({sharded} sharded, the rest replicated) · "
                 f"all-reduce via {rec.communicator}\n")
    bad = [s.index for s in run.steps
           if any(len({c.sha256_out for c in calls if c.sha256_out}) > 1 for calls in zip(*s.collectives.values()))]
    steps = sum(1 for s in run.steps if s.collectives)
    t.append(f"collectives recorded in {steps} steps; ranks disagree after one in steps {bad}\n" if bad else
             f"collectives recorded in {steps} steps; every rank left each with the same tensor (--step N: per rank)\n",
             style="bold red" if bad else "dim")
    return t


def request_view(run: Run, rid: str, lang: str = "en") -> Group:
    rid = engine_request(run, rid)  # a served run's API id names its engine request
    parts = [step_table(run, focus=rid, lang=lang)]
    t = Table(title=word("blocks_per_step", lang, rid=rid), caption=word("blocks_caption", lang), title_justify="left",
              caption_justify="left", min_width=50)
    t.add_column(word("step", lang), justify="right")
    t.add_column(word("blocks", lang))
    for s in run.steps:
        if s.kv and rid in s.kv.block_tables:
            new = set(s.kv.allocated.get(rid, []))
            hit = {b for h in s.kv.prefix_hits if h.req_id == rid for b in h.block_ids}
            t.add_row(str(s.index), " ".join(f"{b}{'+' if b in new else '*' if b in hit else ''}" for b in s.kv.block_tables[rid]))
    missing = _not_recorded(run, "blocks", f"{rid}'s blocks per step")
    parts += missing or [t]
    if spec_decode.has_spec(run):
        parts.append(spec_decode.spec_table(run, request=rid))
    why = request_summary(run, rid, lang)
    if why:  # the explanation's turns, in short: `vllm-tour explain RUN --request R` has the evidence
        parts.append(Text(word("why", lang, rid=rid) + "\n  " + "\n  ".join(why)))
    if run.outputs:
        for o in run.outputs.requests:
            if o.req_id == rid:
                io = word("io", lang, p=len(o.prompt_token_ids), g=len(o.token_ids), f=o.finish_reason, ids=o.token_ids)
                parts.append(Text(f"{io}\n{o.text!r}"))
    return Group(*parts)


def header(run: Run) -> Text:
    m = run.meta
    e = m.engine_args
    t = Text()
    t.append(f"{run.path}\n", style="bold")
    t.append(f"pin {m.pin} · vLLM {m.vllm_version} · model {m.model} · status {m.status}\n")
    usable = next((s.kv.num_blocks for s in run.steps if s.kv), None)
    # Upstream's pool holds one block more than it hands out: block 0, the null block, a placeholder
    # in block tables that never stores KV. "KV free" below counts the usable blocks only.
    blocks = f"KV blocks {usable} usable + 1 null (block 0, never allocated)" if usable is not None else "KV blocks: no KV records"
    t.append(f"level {m.level} · ", style="dim")
    t.append(f"block_size {e.get('block_size')} · {blocks} · prefix caching {e.get('enable_prefix_caching')} · TP {e.get('tensor_parallel_size')} · budget {e.get('max_num_batched_tokens', 'default')}\n", style="dim")
    att = next((a for s in run.steps for _, a in sorted(s.attention.items())), None)
    if att is not None and att.layers:
        first = att.layers[0]
        layers = (f"{att.num_layers} layers × {att.num_kv_heads} KV heads × head size {att.head_size}, "
                  if att.num_layers is not None else "")
        isa = f" ({att.isa})" if att.isa else ""
        t.append(f"attention {att.backend}{isa}: {layers}KV cache per layer {first.kv_cache_shape} {first.kv_cache_dtype}, "
                 f"layout {att.layout} · dtype {e.get('dtype')}\n", style="dim")
    for r in m.requests[:PROMPTS_SHOWN]:
        ids = r.prompt_token_ids or []
        more = ", …" if len(ids) > PROMPT_IDS_SHOWN else ""
        text = f"{r.prompt[:PROMPT_TEXT_SHOWN]!r}{'…' if len(r.prompt) > PROMPT_TEXT_SHOWN else ''} → " if r.prompt is not None else ""
        t.append(f"{r.req_id}: {text}{len(ids)} prompt tokens [{', '.join(map(str, ids[:PROMPT_IDS_SHOWN]))}{more}]\n", style="dim")
    if len(m.requests) > PROMPTS_SHOWN:
        t.append(f"… and {len(m.requests) - PROMPTS_SHOWN} more requests\n", style="dim")
    if m.weights_note:
        t.append(m.weights_note + "\n", style="yellow")
    return t


def outputs_table(run: Run, lang: str = "en") -> Table:
    t = Table(title=word("outputs", lang), title_justify="left")
    for c in ("request", "prompt", "generated", "finish", "text"):
        t.add_column(word(c, lang), overflow="fold")
    col = colors(run)
    for o in run.outputs.requests if run.outputs else []:
        t.add_row(Text(o.req_id, style=col.get(o.req_id, "")), str(len(o.prompt_token_ids)), str(len(o.token_ids)), o.finish_reason or "", Text(repr(o.text[:60])))
    return t


def _not_recorded(run: Run, needed: str, what: str) -> list[Text]:
    """A section the run's level does not hold is one line saying so, never an empty grid."""
    line = levels.missing_line(run.meta.level, needed, what)
    return [Text(line, style="yellow")] if line else []


def server_table(run: Run) -> Table:
    """`serve` runs: each engine request as the server's front end saw it (times from its arrival there)."""
    t = Table(title="server requests (front end)", title_justify="left")
    for c in ("API id", "engine request", "first token", "total", "finish", "prompt", "generated"):
        t.add_column(c, overflow="fold")
    for r in run.server_requests:
        first = f"{(r.first_token_time - r.arrival_time) * 1000:.0f} ms" if r.first_token_time else "-"
        t.add_row(r.api_id, r.req_id + (f" ({r.index + 1}/{r.n})" if r.n > 1 else ""), first,
                  f"{(r.finished_time - r.arrival_time) * 1000:.0f} ms", r.finish_reason, str(len(r.prompt_token_ids)),
                  str(len(r.token_ids)))
    return t


def load_for_show(run: str, steps: str | None = None, seconds: str | None = None) -> Run:
    """The run, or the window of it that --steps "A-B" or --time "T0-T1" (seconds after its start) names."""
    if steps is not None:
        return load_run(run, steps=parse_window(steps, "--steps", whole=True))
    if seconds is not None:
        return load_run(run, steps=steps_between(run, parse_window(seconds, "--time", whole=False)))
    return load_run(run)


def show(run: Run, console: Console, step: int | None = None, request: str | None = None, lang: str = "en") -> None:
    console.print(header(run))
    for w in run.warnings:
        console.print("[yellow]warning:[/] " + escape(w))
    if step is not None:
        console.print(step_detail(run, run.step(step)))
    elif run.window:
        console.print(step_table(run, lang=lang))
    elif request is not None:
        console.print(request_view(run, request, lang))
    else:
        console.print(step_table(run, lang=lang))
        seen = list(dict.fromkeys(c for s in run.steps for c in step_concepts(s)))
        lines = [line for c in seen if (line := notes_line(c, run.meta.pin))]
        if lines:
            console.print(Text(word("notes", lang) + "\n  " + "\n  ".join(lines), style="dim"))
        if spec_decode.has_spec(run):
            console.print(spec_decode.summary(run))
            console.print(spec_decode.spec_table(run))
        if run.tp_shards:
            console.print(tp_summary(run))
        for line in _not_recorded(run, "blocks", "block tables, KV pool, prefix-cache hits"):
            console.print(line)
        if run.steps:
            busiest = max(run.steps, key=lambda s: (s.kv.num_blocks - s.kv.free_blocks) if s.kv else -1)
            if busiest.kv:
                console.print(block_grid(run, busiest, lang=lang))
        experts = expert_view(run)
        if experts is not None:
            console.print(experts)
        console.print(outputs_table(run, lang))
        if run.server_requests:
            console.print(server_table(run))
    if run.errors:
        e = run.errors[0]
        console.print(f"[bold red]{len(run.errors)} probe error(s)[/]: " + escape(f"first in {e.probe} at step {e.step}: {e.error}"))
