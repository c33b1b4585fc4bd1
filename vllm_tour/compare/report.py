"""Rendering compare results: a rich report for people, JSON for machines."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_tour.compare.modules import MODULES
from vllm_tour.compare.result import CompareResult


def _short(v, n: int = 90) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return escape(s if len(s) <= n else s[: n - 1] + "…")  # "[r0]" is text, not rich markup


def render(result: CompareResult, console: Console, explain: bool = False, max_rows: int = 12) -> None:
    j = result.to_json()
    status = "[green]clean[/]" if result.clean else "[red]DIVERGED[/]"
    console.rule(f"compare {result.module} · {result.scenario} · {status}")
    kernel = result.upstream_backend or "?"
    if result.upstream_isa:  # the CPU kernel's ISA decides its KV layout and the order of its sums
        kernel += f" ({result.upstream_isa} kernel)"
    console.print(f"upstream run: {result.upstream_run}   steps upstream {result.steps_upstream} / reimpl {result.steps_reimpl}"
                  f"   attention {kernel}   ({result.duration_s:.1f}s)")

    exact = result.dtype == "float32"
    t = Table(title="tokens (exact)" if exact else f"tokens ({result.dtype}: top-k rule, reimpl on upstream's tokens)",
              caption=None if exact else result.tokens_rule, show_lines=False)
    for col in ("request", "upstream", "reimpl", ""):
        t.add_column(col, overflow="fold")
    for rid, tok in result.tokens.items():
        same = tok["upstream"] == tok["reimpl"]
        mark = "[yellow]forced[/]" if tok["forced"] else ("[green]=[/]" if same else "[red]≠[/]")
        rule = tok.get("top_k_rule")
        if rule and rule["ok"] and not rule["identical"]:
            mark = f"[yellow]≈ from {rule['first_diff']} (top-k)[/]"
        t.add_row(escape(rid), _short(tok["upstream"], 60), _short(tok["reimpl"], 60), mark)
    console.print(t)

    first = result.first
    if first is not None:
        where = f"step {first.step}" if first.step is not None else "outputs"
        console.print(f"[bold red]first divergence[/]: {where} · [bold]{escape(first.field)}[/]"
                      + (f" · request {escape(first.req_id)}" if first.req_id else ""))
        if first.upstream is not None or first.reimpl is not None:
            console.print(f"  upstream: {_short(first.upstream, 200)}")
            console.print(f"  reimpl:   {_short(first.reimpl, 200)}")
        if first.message:
            console.print(f"  {escape(first.message)}")
    if result.divergences:
        d = Table(title=f"differences in data-flow order ({len(result.divergences)} decision/token, "
                        f"first {max_rows}; each tensor at its first bad step)")
        for col in ("step", "field", "upstream", "reimpl"):
            d.add_column(col, overflow="fold")
        for dv in result.ordered()[:max_rows]:
            d.add_row(str(dv.step) if dv.step is not None else "-", escape(dv.field), _short(dv.upstream), _short(dv.reimpl))
        console.print(d)
    else:
        moe = ("; MoE per layer: top-k expert ids and tokens per expert, each rank's expert map and local token "
               "counts (top-k weights within fp32 tolerance)") if "moe" in MODULES[result.module].sections else ""
        spec = ("; drafts proposed and verified, accepted counts, rejected drafts' slots"
                if "spec_decode" in MODULES[result.module].sections else "")
        console.print("[green]decisions identical[/] at every step: scheduled requests and token counts, "
                      "preemptions, finishes, block tables, new/freed/evicted blocks, prefix hits, runner inputs, slot mapping"
                      + moe + spec)

    if result.tensors:
        tol = j["tolerance"]
        tt = Table(title=f"tensors (tolerance {tol.get('name', 'fp32')}: {escape(tol['rule'])})", caption=tol.get("reason"))
        pooled = {s.name: s for s in result.tensors if s.step is None}
        for col in ("name", "steps", "max |Δ|", "max rel") + (("gain", "rel rms") if pooled else ()) + ("ok",):
            tt.add_column(col)
        by_name: dict[str, list] = {}
        for s in result.tensors:
            if s.step is not None:
                by_name.setdefault(s.name, []).append(s)
        for name, stats in by_name.items():
            bad = [s.step for s in stats if not s.ok]
            failed = sorted({f for s in stats + [pooled.get(name)] if s for f in s.failed})
            row = [name, f"{len(stats)}" + (f" (bad: {bad[:5]})" if bad else ""),
                   f"{max(s.max_abs for s in stats):.2e}", f"{max(s.max_rel for s in stats):.2e}"]
            if pooled:
                all_steps = pooled.get(name)
                row += [f"{all_steps.gain:+.1e}", f"{all_steps.rel_rms:.1e}"] if all_steps else ["-", "-"]
            tt.add_row(*row, "[red]NO: " + ", ".join(failed) + "[/]" if failed else "[green]yes[/]")
        console.print(tt)
        first_bad = {}
        for s in result.bad_tensors:
            first_bad.setdefault(s.name, s)
        for s in first_bad.values():
            where = "all steps" if s.step is None else f"step {s.step}"
            console.print(f"  [red]{s.name} {where}[/] (failed: {', '.join(s.failed)}): {escape(s.note)}")
    if not result.tensors_judged:
        console.print(f"[yellow]tensors not judged[/]: {escape(result.module)} is judged on decisions and tokens only")
    if result.not_compared:
        console.print("[bold]not compared[/]:")
        for item in result.not_compared:
            console.print(f"  - {escape(item['what'])}: [dim]{escape(item['why'])}[/]")
    for n in result.notes:
        console.print(f"[dim]note: {escape(n)}[/]")
    if explain and result.explain:
        render_explain(result.explain, console)


def render_explain(ex: dict, console: Console) -> None:
    step = ex.get("step")
    console.rule(f"explain: state at step {step}")
    if step is None:
        console.print(_short(ex.get("divergence"), 400))
        return
    t = Table(show_lines=True)
    t.add_column("", style="bold")
    t.add_column("upstream", overflow="fold")
    t.add_column("reimpl", overflow="fold")
    up, re_ = ex["upstream"], ex["reimpl"]
    for k in up:
        if up[k] != re_.get(k):
            t.add_row(f"[red]{k}[/]", _short(up[k], 300), _short(re_.get(k), 300))
        else:
            t.add_row(k, _short(up[k], 300), "[dim]same[/]")
    console.print(t)
    prev = ex.get("previous_step")
    if prev:
        console.print(f"[bold]step {step - 1}[/] (before): block tables upstream {_short(prev['upstream'].get('block_tables'), 200)}")
        console.print(f"                     reimpl   {_short(prev['reimpl'].get('block_tables'), 200)}")
    st = ex.get("reimpl_internal_state")
    if st:
        console.print("[bold]reimpl scheduler state after schedule()[/]: "
                      f"budget {st['token_budget']} (left {st['budget_left']}), admission stopped by "
                      f"{st['admission_stopped_by'] or '-'}, free blocks {st['free_blocks']}, "
                      f"free queue head {st['free_queue_head']}")
        for q in ("running", "waiting"):
            rows = ", ".join(f"{escape(r['req_id'])}({r['num_computed_tokens']}/{r['num_tokens']})" for r in st[q])
            console.print(f"  {q}: {rows or '-'}")
