"""The reimpl matches upstream exactly (tokens, decisions) and within tolerance (tensors) on every compare scenario."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from vllm_tour.cli import app
from vllm_tour.compare.modules import MODULES
from vllm_tour.compare.pytest_plugin import assert_matches_upstream
from vllm_tour.errors import TourError

CMP = ["cmp_single", "cmp_concurrent", "cmp_shared_prefix", "cmp_preempt", "cmp_chunked",
       "cmp_arrivals", "cmp_mixed_max_tokens", "cmp_evict"]


# reimpl.triton_attn needs the Triton interpreter from process start on CPU:
# tests/test_compare_triton.py runs it through the CLI in its own process.
# reimpl.tp: test_compare_tp.py; reimpl.ep judges MoE routing: test_compare_ep.py runs it on the MoE scenarios;
# reimpl.spec_decode: test_spec_decode.py (its scenarios, and one of these without drafts).
IN_PROCESS = [name for name, m in MODULES.items()
              if not m.triton and m.world_size == 1 and not m.moe_only and not m.speculative]


@pytest.mark.parametrize("module", IN_PROCESS)
@pytest.mark.parametrize("name", CMP)
def test_reimpl_matches_upstream(compare_upstream, module, name):
    result = compare_upstream(module, name)
    assert_matches_upstream(result)
    assert result.steps_upstream == result.steps_reimpl > 0
    if module == "reimpl.paged_attn":
        names = {t.name for t in result.tensors}
        assert {"attn_out.layers.0", "kv_blocks.layers.1"} <= names
        assert max(t.max_abs for t in result.tensors) <= 1e-5
        tol = result.to_json()["tolerance"]  # CPU upstream: fp32 tolerance, v0.32.0 policies
        assert (tol["atol"], tol["rtol"], tol["name"], tol["upstream_attention_backend"]) == (1e-5, 1e-5, "fp32", "CPUAttention")
    assert not any(n.startswith("reimpl policy for pin") for n in result.notes)


def test_scenarios_exercise_what_they_claim(upstream_run):
    """Each scenario really drives its path upstream (else a clean compare proves little)."""
    def steps(name):
        return upstream_run(name).steps.values()

    assert any(s["scheduler"]["preempted"] for s in steps("cmp_preempt"))
    assert any(r["kind"] == "resumed" for s in steps("cmp_preempt") for r in s["scheduler"]["scheduled"])
    assert any(h["num_hit_tokens"] for s in steps("cmp_shared_prefix") for h in s["kv"]["prefix_hits"])
    assert any(s["kv"]["evicted"] for s in steps("cmp_evict"))
    chunked = [r for s in steps("cmp_chunked") for r in s["scheduler"]["scheduled"]
               if r["is_prefill"] and r["num_computed_tokens"] + r["num_scheduled_tokens"] < r["num_prompt_tokens"]]
    assert chunked, "no prompt was split into chunks"
    assert any(s["scheduler"]["waiting_after"] for s in steps("cmp_concurrent"))  # max_num_seqs held some back
    assert len({len(t) for t in upstream_run("cmp_mixed_max_tokens").outputs.values()}) >= 3


def test_cli_all_scenarios_exit_0_and_json(tmp_path, upstream_run):
    for name in CMP:
        upstream_run(name)  # warm the shared cache
    out = tmp_path / "report.json"
    r = CliRunner().invoke(app, ["compare", "reimpl.chunked_prefill", "--all-scenarios", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["status"] == "clean"
    names = {s["scenario"] for s in report["scenarios"]}
    assert set(CMP) <= names
    assert {s["scenario"] for s in report["skipped"]} >= {"tp2"}  # TP=2: listed as skipped, with the reason


def _code(result) -> int:
    """Exit code as `vllm-tour` gives it: cli.main turns a TourError into one line + exit 2."""
    return result.exception.exit_code if isinstance(result.exception, TourError) else result.exit_code


def test_could_not_run_exits_2(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["compare", "reimpl.nope", "--scenario", "traces/scenarios/cmp_single.toml"])
    assert _code(r) == 2 and "unknown module" in str(r.exception)
    r = runner.invoke(app, ["compare", "reimpl.paged_attn", "--scenario", str(tmp_path / "missing.toml")])
    assert _code(r) == 2 and "does not exist" in str(r.exception)
    r = runner.invoke(app, ["compare", "reimpl.paged_attn", "--scenario", "traces/scenarios/tp2.toml"])
    assert _code(r) == 2 and "tensor_parallel_size=2" in str(r.exception)
    r = runner.invoke(app, ["compare", "reimpl.paged_attn"])
    assert _code(r) == 2


def test_could_not_run_is_one_line_exit_2_from_the_real_command():
    p = subprocess.run([sys.executable, "-m", "vllm_tour", "compare", "reimpl.nope", "--all-scenarios"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"error: unknown module 'reimpl.nope' (known: {', '.join(MODULES)})"]


def test_the_upstream_cache_key_follows_what_records_and_not_the_views(monkeypatch, tmp_path):
    """Cached upstream runs are keyed by the code that writes their records (probes, schema, writer, driver): an
    edit there re-runs upstream; an edit to a view (show, export, the site) must not throw every run away."""
    from pathlib import Path

    from vllm_tour.compare import upstream

    read = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or real(self))
    upstream._probe_sources_digest()
    root = Path(upstream.__file__).resolve().parent.parent
    names = {p.relative_to(root).as_posix() for p in read}
    assert {"probes/plugin.py", "probes/scheduler.py", "trace/schema.py", "trace/writer.py", "engine/run.py"} <= names
    assert not names & {"views/show.py", "trace/reader.py", "views/event_notes.py", "views/perfetto.py"}
