"""`vllm-tour diff RUN_A RUN_B`: where two runs first differ, field by field, and how much differs after.

Two runs of one scenario on two releases, or on two configurations of one release, are compared by
content, step by step (steps are aligned by index: step N of A against step N of B):

- every record kind both runs hold (scheduler, kv, runner, attention, moe, collective, capture
  metadata, tp_shards), with the fields that change from run to run without meaning anything left
  out: `time`, `duration_s` and the writing process (`proc`: its pid; the TP rank stays, as the key
  the record is filed under);
- the outputs, request by request: the first differing token position, finish reasons, text.

A kind only one run holds (a `steps`-level run against a `blocks` one has no KV records) is not
compared, and the report says so: a difference that could not be seen is never reported as
equality without that caveat. meta.json (release, engine arguments, model) is shown as context:
two releases that schedule alike are equal runs even though their pins differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_tour.compare.tokens import first_difference
from vllm_tour.errors import TourError
from vllm_tour.trace.reader import Run, Step

# Every record kind diff knows, in the order its report lists them.
KINDS = ("scheduler", "kv", "runner", "attention", "moe", "collective", "capture", "tp_shards", "outputs")
VOLATILE = {"time", "duration_s", "proc", "step", "kind"}  # `step` and `kind` are the alignment keys themselves
SHOWN_ITEMS = 12  # a list value shows this many items, then "… (N in all)"
SETUP_FIELDS = ("pin", "vllm_version", "model", "model_digest", "weights", "level", "status")


class _Missing:
    def __repr__(self) -> str:
        return "(none)"


MISSING = _Missing()  # a key or record one side lacks


@dataclass
class FieldDiff:
    field: str  # e.g. "scheduler.scheduled[r2].num_scheduled_tokens", "kv.block_tables.r1"
    a: object
    b: object

    @property
    def top(self) -> str:
        """The record field it belongs to ("kv.block_tables"), for the summary of later steps."""
        kind, _, rest = self.field.split(" (")[0].partition(".")
        head = rest.replace("[", ".").split(".")[0] if rest else ""
        return f"{kind}.{head}" if head else kind


@dataclass
class RunDiff:
    a: Run
    b: Run
    compared: list[str]
    not_compared: dict[str, str]  # kind -> why (which run lacks it)
    setup: list[FieldDiff]  # meta.json context: release, engine args, model
    steps: dict[int, list[FieldDiff]] = field(default_factory=dict)  # step -> its differences (differing steps only)
    outputs: list[FieldDiff] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.steps and not self.outputs

    @property
    def first_step(self) -> int | None:
        return min(self.steps) if self.steps else None

    def later_summary(self) -> tuple[list[int], dict[str, int]]:
        """Steps after the first differing one that differ too, and per record field in how many of them."""
        later = sorted(self.steps)[1:]
        counts: dict[str, int] = {}
        for s in later:
            for top in dict.fromkeys(d.top for d in self.steps[s]):
                counts[top] = counts.get(top, 0) + 1
        return later, dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def to_json(self) -> dict:
        later, counts = self.later_summary()
        return {
            "equal": self.equal,
            "a": _run_facts(self.a), "b": _run_facts(self.b),
            "compared": self.compared, "not_compared": self.not_compared,
            "setup": [_fd_json(d) for d in self.setup],
            "first_step": self.first_step,
            "first_step_fields": [_fd_json(d) for d in self.steps.get(self.first_step, [])],
            "later_steps": later, "later_fields": counts,
            "outputs": [_fd_json(d) for d in self.outputs],
            "notes": self.notes,
        }


def _fd_json(d: FieldDiff) -> dict:
    return {"field": d.field, "a": d.a, "b": d.b}


def _run_facts(run: Run) -> dict:
    return {"path": str(run.path), "pin": run.meta.pin, "vllm_version": run.meta.vllm_version, "level": run.meta.level,
            "steps": len(run.steps), "status": run.meta.status}


# --- what each run holds --------------------------------------------------------------------------


def _dump(rec) -> dict:
    return rec.model_dump(exclude=VOLATILE)


def _by_rank(records: dict) -> dict:
    return {rank: _dump(r) for rank, r in sorted(records.items())}


def _lists_by_rank(records: dict) -> dict:
    return {rank: [_dump(r) for r in recs] for rank, recs in sorted(records.items())}


def step_content(step: Step) -> dict[str, object]:
    """The step's records by kind, as plain values without volatile fields (kinds it lacks: absent)."""
    out: dict[str, object] = {}
    if step.scheduler is not None:
        out["scheduler"] = _dump(step.scheduler)
    if step.kv is not None:
        out["kv"] = _dump(step.kv)
    if step.runner:
        out["runner"] = _by_rank(step.runner)
    if step.attention:
        out["attention"] = _by_rank(step.attention)
    if step.moe:
        out["moe"] = _lists_by_rank(step.moe)
    if step.collectives:
        out["collective"] = _lists_by_rank(step.collectives)
    if step.captures:
        # The tensors themselves are not compared (bit-level equality across machines is no promise:
        # DESIGN.md); their names, shapes, dtypes and block ids are.
        out["capture"] = sorted((_dump(c) for c in step.captures), key=lambda c: c["name"])
    return out


def kinds_held(run: Run) -> set[str]:
    held = {k for s in run.steps for k in step_content(s)}
    if run.tp_shards:
        held.add("tp_shards")
    if run.outputs is not None:
        held.add("outputs")
    return held


# --- comparing values -------------------------------------------------------------------------------


def _keyed(items: list) -> dict | None:
    """A list of request records keyed by req_id (None when it is not one: no or duplicate ids)."""
    if not all(isinstance(x, dict) and "req_id" in x for x in items):
        return None
    keys = [x["req_id"] for x in items]
    return None if len(set(keys)) != len(keys) else dict(zip(keys, items))


def diff_values(a, b, path: str) -> list[FieldDiff]:
    """Every leaf where `a` and `b` differ, named by its path. Per-request lists (scheduled, preempted,
    prefix hits) are matched by request id, and their batch order is one field of its own."""
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in dict.fromkeys([*a, *b]):
            sub = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append(FieldDiff(sub, a.get(k, MISSING), b.get(k, MISSING)))
            else:
                out += diff_values(a[k], b[k], sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and (a or b):
        # An empty list is keyed too: [] against [r2's record] is a batch without r2
        ka, kb = (_keyed(a) if a else {}), (_keyed(b) if b else {})
        if ka is not None and kb is not None:
            out = []
            if list(ka) != list(kb):
                # The batch itself: which requests, in which order
                out.append(FieldDiff(f"{path} (requests)", list(ka), list(kb)))
            for rid in dict.fromkeys([*ka, *kb]):
                x = {k: v for k, v in ka.get(rid, {}).items() if k != "req_id"}
                y = {k: v for k, v in kb.get(rid, {}).items() if k != "req_id"}
                if rid not in ka or rid not in kb:
                    out.append(FieldDiff(f"{path}[{rid}]", x or MISSING, y or MISSING))
                else:
                    out += diff_values(x, y, f"{path}[{rid}]")
            return out
        if len(a) == len(b) and all(isinstance(x, dict) for x in a + b):
            out = []
            for i, (x, y) in enumerate(zip(a, b)):
                out += diff_values(x, y, f"{path}[{i}]")
            return out
    return [FieldDiff(path, a, b)]


def _rank_paths(diffs: list[FieldDiff], kind: str, ranks: set) -> list[FieldDiff]:
    """runner.0.x -> runner.x when both runs are single-rank (the rank says nothing there); else runner[rank 1].x."""
    out = []
    for d in diffs:
        head, _, rest = d.field.partition(".")
        rank, _, tail = rest.partition(".")
        if head == kind and rank.isdigit():
            d = FieldDiff(f"{kind}.{tail}" if ranks <= {0} else f"{kind}[rank {rank}]" + (f".{tail}" if tail else ""), d.a, d.b)
        out.append(d)
    return out


def _step_diffs(sa: dict, sb: dict, kinds: list[str], ranks: set) -> list[FieldDiff]:
    out = []
    for kind in kinds:
        if kind in ("tp_shards", "outputs"):
            continue
        va, vb = sa.get(kind, MISSING), sb.get(kind, MISSING)
        if va is MISSING or vb is MISSING:
            if va is not vb:
                out.append(FieldDiff(kind, "recorded" if va is not MISSING else MISSING,
                                     "recorded" if vb is not MISSING else MISSING))
            continue
        diffs = diff_values(va, vb, kind)
        out += _rank_paths(diffs, kind, ranks) if kind in ("runner", "attention", "moe", "collective") else diffs
    return out


def output_diffs(a: Run, b: Run) -> list[FieldDiff]:
    """Per request: prompt ids, generated tokens (from their first differing position), finish reason, text."""
    oa = {o.req_id: o for o in a.outputs.requests}
    ob = {o.req_id: o for o in b.outputs.requests}
    out = []
    for rid in dict.fromkeys([*oa, *ob]):
        if rid not in oa or rid not in ob:
            out.append(FieldDiff(f"outputs[{rid}]", "present" if rid in oa else MISSING, "present" if rid in ob else MISSING))
            continue
        x, y = oa[rid], ob[rid]
        if x.prompt_token_ids != y.prompt_token_ids:
            out.append(FieldDiff(f"outputs[{rid}].prompt_token_ids", x.prompt_token_ids, y.prompt_token_ids))
        pos = first_difference(x.token_ids, y.token_ids)
        if pos is not None:
            out.append(FieldDiff(f"outputs[{rid}].token_ids from position {pos}", x.token_ids[pos:], y.token_ids[pos:]))
        if x.finish_reason != y.finish_reason:
            out.append(FieldDiff(f"outputs[{rid}].finish_reason", x.finish_reason, y.finish_reason))
        if x.text != y.text and pos is None:  # same tokens, other text: the detokenizer differs
            out.append(FieldDiff(f"outputs[{rid}].text", x.text, y.text))
    return out


def setup_diffs(a: Run, b: Run) -> list[FieldDiff]:
    ma, mb = a.meta.model_dump(), b.meta.model_dump()
    out = [FieldDiff(k, ma.get(k), mb.get(k)) for k in SETUP_FIELDS if ma.get(k) != mb.get(k)]
    out += diff_values(ma.get("engine_args") or {}, mb.get("engine_args") or {}, "engine_args")
    ra = {r.req_id: r.model_dump(exclude={"req_id"}) for r in a.meta.requests}
    rb = {r.req_id: r.model_dump(exclude={"req_id"}) for r in b.meta.requests}
    if list(ra) != list(rb):  # other scenarios: their request ids say enough here
        out.append(FieldDiff("requests", list(ra), list(rb)))
    else:
        out += [FieldDiff(f"requests[{d.field.split('.')[1]}].{d.field.split('.', 2)[2]}", d.a, d.b)
                for d in diff_values(ra, rb, "requests")]
    return out


def check_kinds(kinds: list[str] | None) -> list[str] | None:
    """--kinds as given (comma-separated or repeated), checked against KINDS; None: every kind."""
    if not kinds:
        return None
    asked = [k.strip() for item in kinds for k in item.split(",") if k.strip()]
    bad = [k for k in asked if k not in KINDS]
    if bad:
        raise TourError(f"--kinds {bad[0]!r}: choose among {', '.join(KINDS)}")
    return asked


def diff_runs(a: Run, b: Run, kinds: list[str] | None = None) -> RunDiff:
    """Compare two loaded runs (see the module docstring for what counts); `kinds`: only these record kinds."""
    ha, hb = kinds_held(a), kinds_held(b)
    compared = [k for k in KINDS if k in ha and k in hb and (kinds is None or k in kinds)]
    not_compared = {k: "not asked for" for k in KINDS if kinds is not None and k not in kinds and (k in ha or k in hb)}
    for k in KINDS:
        if k in not_compared:
            continue
        if (k in ha) != (k in hb):
            which, other, name = ("A", b, "B") if k in ha else ("B", a, "A")
            if k != "outputs":
                not_compared[k] = f"only in {which}; {name} was recorded at level {other.meta.level}"
            else:
                not_compared[k] = f"only in {which}; {name} did not finish"
    res = RunDiff(a, b, compared, not_compared, setup_diffs(a, b))
    ca = {s.index: step_content(s) for s in a.steps}
    cb = {s.index: step_content(s) for s in b.steps}
    ranks = {r for run in (a, b) for s in run.steps for r in (*s.runner, *s.attention, *s.moe, *s.collectives)}
    step_kinds = [k for k in compared if k not in ("tp_shards", "outputs")]
    for idx in sorted(set(ca) | set(cb)):
        if idx not in ca or idx not in cb:
            res.steps[idx] = [FieldDiff("step", "recorded" if idx in ca else MISSING, "recorded" if idx in cb else MISSING)]
            continue
        d = _step_diffs(ca[idx], cb[idx], step_kinds, ranks)
        if d:
            res.steps[idx] = d
    if "tp_shards" in compared:
        d = diff_values(_lists_by_rank({r: [x] for r, x in a.tp_shards.items()}),
                        _lists_by_rank({r: [x] for r, x in b.tp_shards.items()}), "tp_shards")
        if d:  # written once per rank before step 1: filed under step 0
            res.steps[0] = d
    if "outputs" in compared:
        res.outputs = output_diffs(a, b)
    for run, name in ((a, "A"), (b, "B")):
        if run.errors:
            res.notes.append(f"{name} holds {len(run.errors)} probe error(s): records those probes failed to write are missing there")
        for w in run.warnings:
            res.notes.append(f"{name}: {w}")
    return res


# --- rendering ------------------------------------------------------------------------------------


def show_value(v) -> str:
    if v is MISSING:
        return "(none)"
    if isinstance(v, dict) and set(v) >= {"length", "full", "sha256"}:  # an IntList
        if v.get("full") is not None:
            v = v["full"]
        else:
            return f"{v['length']} values, sha256 {str(v.get('sha256'))[:12]}…"
    if isinstance(v, dict):  # one request's record that the other run lacks: its fields in one line
        return ", ".join(f"{k}={show_value(x)}" for k, x in v.items())
    if isinstance(v, list) and len(v) > SHOWN_ITEMS:
        return "[" + ", ".join(map(str, v[:SHOWN_ITEMS])) + f", … ({len(v)} in all)]"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def _label(run: Run, name: str) -> str:
    m = run.meta
    return (f"{name}: {run.path.name}  (pin {m.pin}, vLLM {m.vllm_version or '?'}, level {m.level}, "
            f"{len(run.steps)} steps, {m.status})")


def _table(title: str, diffs: list[FieldDiff]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("field", "A", "B"):
        table.add_column(col, overflow="fold")
    for d in diffs:
        table.add_row(escape(d.field), escape(show_value(d.a)), escape(show_value(d.b)))
    return table


def render(res: RunDiff, console: Console) -> None:
    console.print(escape(_label(res.a, "A")), highlight=False)
    console.print(escape(_label(res.b, "B")), highlight=False)
    if res.setup:
        console.print("setup (context, not counted): " + escape("; ".join(
            f"{d.field} {show_value(d.a)} vs {show_value(d.b)}" for d in res.setup)), highlight=False)
    line = "compared: " + (", ".join(res.compared) or "nothing")
    if res.not_compared:
        by_why: dict[str, list[str]] = {}
        for k, why in res.not_compared.items():
            by_why.setdefault(why, []).append(k)
        line += "; not compared: " + "; ".join(f"{', '.join(ks)} ({why})" for why, ks in by_why.items())
    console.print(escape(line), highlight=False)
    for n in res.notes:
        console.print("[yellow]note:[/] " + escape(n))
    if res.equal:
        console.print(f"[green]equal[/]: {len(res.a.steps)} steps" + (" and the outputs" if "outputs" in res.compared else "")
                      + " hold the same records")
        return
    first = res.first_step
    if first is not None:
        where = "before step 1 (tp_shards)" if first == 0 else f"step {first}"
        console.print(_table(f"first difference: {where} ({len(res.steps[first])} field(s))", res.steps[first]))
        later, counts = res.later_summary()
        if later:
            fields = ", ".join(f"{k} ({n})" for k, n in counts.items())
            console.print(escape(f"later: {len(later)} more step(s) differ ({_ranges(later)}); fields (steps): {fields}"),
                          highlight=False)
        else:
            console.print("later: no other step differs")
    else:
        console.print("steps: equal")
    if res.outputs:
        console.print(_table(f"outputs: {len({d.field.split(']')[0] for d in res.outputs})} request(s) differ", res.outputs))
    elif "outputs" in res.compared:
        console.print("outputs: equal")


def _ranges(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> "steps 3-5, 9"."""
    parts, start, prev = [], None, None
    for s in steps:
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = s
    parts.append(f"{start}-{prev}" if prev != start else str(start))
    return "steps " + ", ".join(parts)
