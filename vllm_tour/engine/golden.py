"""Golden traces: small, checked-in runs of the canonical scenarios, compared field by field.

`traces/golden/<scenario>/` is an ordinary run directory (so `vllm-tour show
preemption` works on it) whose records are normalized: wall times, durations
and pids zeroed, one records file. `deterministic(run)` is what a re-recording
must reproduce exactly: every scheduler, KV, runner and attention field except
time and process identity, plus the generated tokens.

Re-record after an intended change:  python -m vllm_tour.engine.golden [SCENARIO ...]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from vllm_tour.paths import GOLDEN_DIR, REPO_ROOT, SCENARIOS_DIR
from vllm_tour.trace.reader import Run, load_run, read_records

GOLDEN_SCENARIOS = ("single", "concurrent8", "shared_prefix", "preemption", "chunked_prefill", "tp2", "spec_ngram")
_VOLATILE = {"time", "duration_s", "proc"}


def _clean(record) -> dict:
    return record.model_dump(mode="json", exclude=_VOLATILE)


def deterministic(run: Run) -> dict:
    steps = []
    for s in run.steps:
        steps.append(
            {
                "step": s.index,
                "scheduler": _clean(s.scheduler) if s.scheduler else None,
                "kv": _clean(s.kv) if s.kv else None,
                "runner": {str(r): _clean(v) for r, v in sorted(s.runner.items())},
                "attention": {str(r): _clean(v) for r, v in sorted(s.attention.items())},
                "spec_verify": _clean(s.spec_verify) if s.spec_verify else None,
                "spec_proposal": _clean(s.spec_proposal) if s.spec_proposal else None,
                "errors": [e.probe for e in s.errors],
            }
        )
    outputs = {o.req_id: {"prompt": o.prompt_token_ids, "tokens": o.token_ids, "finish": o.finish_reason} for o in (run.outputs.requests if run.outputs else [])}
    return {"steps": steps, "outputs": outputs}


def first_differences(expected: dict, actual: dict, limit: int = 5) -> list[str]:
    """Where two deterministic views differ: 'steps[3].kv.block_tables.r1: [1, 2] != [1, 3]'."""
    out: list[str] = []

    def walk(a, b, where: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in list(a) + [k for k in b if k not in a]:
                walk(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}.{k}" if where else str(k))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]")
        elif a != b:
            out.append(f"{where}: expected {json.dumps(a)[:200]} got {json.dumps(b)[:200]}")

    walk(expected, actual, "")
    return out


# Environment kept in a golden's meta (the rest is machine noise): what changes upstream's numbers.
NUMERICS_ENV = ("TRITON_F32_DEFAULT",)


def write_golden(run: Run, dest: Path, drop_capture_records: bool = False) -> Path:
    """Copy a run to `dest` with volatile fields normalized and captures left out.

    drop_capture_records: also leave out the `capture` records (and engine_args.capture), as if the run
    had captured nothing -- for a run traced with captures for a compare (what a capture records is
    beside the probes' records, never in them)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    meta = run.meta.model_dump(mode="json")
    env = {k: v for k, v in (meta.get("env") or {}).items() if k in NUMERICS_ENV}  # they decide the numbers
    server = (meta.get("engine_args") or {}).get("server")
    if isinstance(server, dict) and server.get("argv"):  # a serve run: its argv names this machine's paths too
        here = {meta["model_path"]: "<cache>/" + Path(meta["model_path"]).name, str(REPO_ROOT): "<repo>"}
        server["argv"] = [next((a.replace(k, v, 1) for k, v in here.items() if a.startswith(k)), a) for a in server["argv"]]
    meta.update(started=0.0, finished=0.0, model_path="<cache>/" + Path(meta["model_path"]).name, env=env, platform={})
    if drop_capture_records and isinstance(meta.get("engine_args"), dict) and "capture" in meta["engine_args"]:
        meta["engine_args"]["capture"] = []
    (dest / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    shutil.copy(run.path / "outputs.json", dest / "outputs.json")
    lines = []
    for f in sorted(run.path.glob("records.*.jsonl")):
        for rec in (r.model_dump(mode="json") for r in read_records(f, [])):
            if drop_capture_records and rec["kind"] == "capture":
                continue
            rec["proc"]["pid"] = 0
            if rec["kind"] == "scheduler":
                rec["time"], rec["duration_s"] = 0.0, 0.0
            lines.append(rec)
    order = {"scheduler": 0, "kv": 1, "attention": 2, "runner": 3, "capture": 4, "probe_error": 5}
    lines.sort(key=lambda r: (r["step"], order.get(r["kind"], 9), r["proc"]["rank"]))
    (dest / "records.0.jsonl").write_text("".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in lines))
    return dest


def record(names: list[str]) -> None:
    from vllm_tour.engine.run import run_upstream
    from vllm_tour.scenario import load_scenario

    for name in names:
        run_dir = run_upstream(load_scenario(SCENARIOS_DIR / f"{name}.toml"), Path("/tmp") / f"vllm-tour-golden-{name}")
        dest = write_golden(load_run(run_dir), GOLDEN_DIR / name)
        print(f"{name}: {dest} ({sum(f.stat().st_size for f in dest.iterdir()) // 1024} KiB)")


if __name__ == "__main__":
    record(sys.argv[1:] or list(GOLDEN_SCENARIOS))
