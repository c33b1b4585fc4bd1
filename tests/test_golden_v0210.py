"""Golden traces recorded on the H200 (upstream vLLM 0.21.0, CUDA, TRITON_ATTN, fp32) by
vllm_tour/gpu/cuda_run.sh. They cannot be re-recorded on CPU; what is checked here: every
probe family recorded on CUDA, and the reimpl's decisions and tokens against them."""

import json
import shutil
from pathlib import Path

import pytest

from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.trace.reader import load_run

V0210 = GOLDEN_DIR / "v0.21.0"
NAMES = ("single", "chunked_prefill", "preemption", "shared_prefix")


@pytest.mark.parametrize("name", NAMES)
def test_cuda_golden_has_every_record_kind(name):
    d = V0210 / name
    meta = json.loads((d / "meta.json").read_text())
    assert meta["pin"] == "v0.21.0" and meta["status"] == "ok"
    assert meta["engine_args"]["attention_config"] == {"backend": "TRITON_ATTN"}
    assert meta["engine_args"]["async_scheduling"] is False
    recs = [json.loads(line) for line in (d / "records.0.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in recs}
    assert kinds == {"scheduler", "kv", "attention", "runner"}  # and no probe_error
    att = next(r for r in recs if r["kind"] == "attention")
    assert att["backend"] == "TritonAttention" and att["layout"] == "[blocks, 2, block_size, kv_heads, head]"
    steps = {k: sorted({r["step"] for r in recs if r["kind"] == k}) for k in kinds}
    assert len({tuple(v) for v in steps.values()}) == 1  # one record of each kind per step
    assert sum(f.stat().st_size for f in d.iterdir()) < 200 << 10
    load_run(d)  # the reader takes it


@pytest.mark.parametrize("name", ["single", "chunked_prefill"])
def test_reimpl_matches_upstream_cuda_exactly(tmp_path, name):
    """fp32: reimpl.chunked_prefill (on CPU) vs upstream's CUDA engine: decisions and tokens identical."""
    from vllm_tour.compare import harness
    from vllm_tour.models import resolve_model

    run = tmp_path / name
    shutil.copytree(V0210 / name, run)
    meta = json.loads((run / "meta.json").read_text())
    meta["model_path"] = str(resolve_model(meta["model"]))  # goldens store "<cache>/…"
    (run / "meta.json").write_text(json.dumps(meta))
    r = harness.compare("reimpl.chunked_prefill", harness.SCENARIOS_DIR / f"{name}.toml", upstream_run=run).to_json()
    assert r["status"] == "clean", r["first_divergence"]
