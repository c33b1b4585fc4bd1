"""compare --impl: a learner's own component file runs in place of the reference, judged against live upstream;
a file that cannot work is refused in one line (exit 2) before any engine starts."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_tour.cli import app
from vllm_tour.compare.components import COMPONENTS, check_impl, load_impl
from vllm_tour.compare.modules import MODULES
from vllm_tour.compare.pytest_plugin import assert_matches_upstream
from vllm_tour.errors import TourError

ROOT = Path(__file__).resolve().parents[1]
EVICT = "traces/scenarios/cmp_evict.toml"


def learner_file(tmp_path: Path, component: str, planted: tuple[str, str] | None = None, name: str | None = None) -> Path:
    """A copy of the component's reference file, as a learner starts from, with one bug planted (old -> new)."""
    module = COMPONENTS[component].reference.split(":")[0]
    text = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    if planted:
        old, new = planted
        assert text.count(old) == 1, f"the planted bug's anchor {old!r} must occur once in {module}"
        text = text.replace(old, new)
    path = tmp_path / (name or f"my_{component}{'_bug' if planted else ''}.py")
    path.write_text(text)
    return path


# --- the CLI -------------------------------------------------------------------------------


def test_cli_own_block_pool_copy_is_clean(upstream_run, tmp_path):
    upstream_run("cmp_evict")
    mine = learner_file(tmp_path, "block_pool")
    out = tmp_path / "report.json"
    r = CliRunner().invoke(app, ["compare", "reimpl.paged_attn", "--impl", f"block_pool={mine}:BlockPool",
                                 "--scenario", EVICT, "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["impl"] == {"block_pool": f"{mine}:BlockPool"}
    assert report["scenarios"][0]["impl"] == {"block_pool": f"{mine}:BlockPool"}


def test_cli_block_pool_taking_free_blocks_from_the_wrong_end_names_step_and_field(upstream_run, tmp_path):
    steps = upstream_run("cmp_evict").steps
    mine = learner_file(tmp_path, "block_pool", ("self._q.popitem(last=False)", "self._q.popitem(last=True)"))
    out = tmp_path / "report.json"
    r = CliRunner().invoke(app, ["compare", "reimpl.paged_attn", "--impl", f"block_pool={mine}", "--scenario", EVICT,
                                 "--json", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    first = json.loads(out.read_text())["scenarios"][0]["first_divergence"]
    rid = steps[1]["scheduler"]["scheduled"][0]["req_id"]
    assert (first["step"], first["field"]) == (1, f"kv.block_tables[{rid}]")
    # upstream hands out the front of the free queue (ascending ids), the bug its back (descending)
    assert first["upstream"] == sorted(first["upstream"]) and first["reimpl"] == sorted(first["reimpl"], reverse=True)
    assert f"first divergence: step 1 · kv.block_tables[{rid}]" in r.output


def test_bad_impl_files_are_refused_in_one_line_before_any_engine_starts(tmp_path):
    """Missing file, syntax error, missing name, missing method, wrong signature, wrong component: exit 2,
    one line naming the problem, and neither vLLM nor the reimpl engine imported (--fresh would start upstream)."""
    ok = learner_file(tmp_path, "block_pool")
    syntax_error = tmp_path / "syntax.py"
    syntax_error.write_text(ok.read_text() + "def broken(:\n")
    cases = {
        "no such file": f"block_pool={tmp_path / 'missing.py'}",
        "is not a Python file": f"block_pool={_write(tmp_path / 'notes.txt', 'class BlockPool: pass')}",
        "SyntaxError": f"block_pool={syntax_error}",
        "has no MyPool": f"block_pool={ok}:MyPool",
        "has no method touch(self, blocks)": f"block_pool={learner_file(tmp_path, 'block_pool', ('def touch(', 'def touch_all('), 'no_touch.py')}",
        "BlockPool.free_blocks(self, ordered_blocks, now) does not match the reference's free_blocks(self, ordered_blocks)":
            f"block_pool={learner_file(tmp_path, 'block_pool', ('def free_blocks(self, ordered_blocks: list[Block])', 'def free_blocks(self, ordered_blocks, now)'), 'extra_param.py')}",
        "KVCacheManager.__init__": f"scheduler={learner_file(tmp_path, 'kv_cache_manager')}:KVCacheManager",
        "reimpl.paged_attn has no component 'pool'": f"pool={ok}",
        "expected COMPONENT=FILE.py[:Name]": str(ok),
    }
    script = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from vllm_tour.cli import app\n"
        "out = {}\n"
        f"for want, impl in {cases!r}.items():\n"
        f"    r = CliRunner().invoke(app, ['compare', 'reimpl.paged_attn', '--impl', impl, '--scenario', {EVICT!r}, '--fresh'])\n"
        "    out[want] = [type(r.exception).__name__, str(r.exception)]\n"
        "out['imported'] = sorted(m for m in ('vllm', 'reimpl.engine') if m in sys.modules)\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got.pop("imported") == []
    for want, (kind, message) in got.items():
        assert kind == "TourError" and want in message and "\n" not in message, (want, message)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_real_command_prints_one_error_line_and_exits_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "vllm_tour", "compare", "reimpl.paged_attn", "--scenario", EVICT,
                        "--impl", f"block_pool={tmp_path / 'nope.py'}"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"error: --impl block_pool={tmp_path / 'nope.py'}: no such file {tmp_path / 'nope.py'}"]


# --- the pytest plugin and compare(impl=...) ---------------------------------------------------


def test_own_scheduler_copy_is_clean_and_a_chunk_one_token_short_is_caught(compare_upstream, tmp_path):
    mine = learner_file(tmp_path, "scheduler")
    for scenario in ("cmp_chunked", "cmp_preempt"):
        assert_matches_upstream(compare_upstream("reimpl.chunked_prefill", scenario, impl={"scheduler": str(mine)}))
    bug = learner_file(tmp_path, "scheduler", ("return min(num_wanted, token_budget)",
                                               "return min(num_wanted, token_budget) - (num_wanted > token_budget)"))
    r = compare_upstream("reimpl.chunked_prefill", "cmp_chunked", impl={"scheduler": str(bug)})
    assert r.exit_code == 1
    assert (r.first.step, r.first.field) == (1, "scheduler.scheduled[long1].num_scheduled_tokens")
    assert (r.first.upstream, r.first.reimpl) == (40, 39)
    assert r.impl == {"scheduler": str(bug)}


def test_own_kv_cache_manager_copy_is_clean_and_freeing_head_first_is_caught(compare_upstream, tmp_path):
    mine = learner_file(tmp_path, "kv_cache_manager")
    for scenario in ("cmp_evict", "cmp_shared_prefix"):
        assert_matches_upstream(compare_upstream("reimpl.paged_attn", scenario, impl={"kv_cache_manager": str(mine)}))
    bug = learner_file(tmp_path, "kv_cache_manager", ("self.block_pool.free_blocks(list(reversed(blocks)))",
                                                      "self.block_pool.free_blocks(blocks)"))
    r = compare_upstream("reimpl.paged_attn", "cmp_evict", impl={"kv_cache_manager": str(bug)})
    assert r.exit_code == 1
    assert (r.first.step, r.first.field) == (4, "kv.block_tables[z]")
    with pytest.raises(AssertionError, match=r"step 4, field kv.block_tables\[z\]"):
        assert_matches_upstream(r)


def test_own_attention_is_judged_on_tensors(compare_upstream, tmp_path):
    mine = learner_file(tmp_path, "paged_attention")
    assert_matches_upstream(compare_upstream("reimpl.paged_attn", "cmp_single", impl={"paged_attention": str(mine)}))
    bug = learner_file(tmp_path, "paged_attention", ("scale = 1.0 / math.sqrt(head_dim)",
                                                     "scale = 1.001 / math.sqrt(head_dim)"))
    r = compare_upstream("reimpl.paged_attn", "cmp_single", impl={"paged_attention": str(bug)})
    assert r.exit_code == 1
    assert r.bad_tensors[0].name == "attn_out.layers.0" and r.bad_tensors[0].step == 1


def test_impl_may_be_the_class_itself(compare_upstream, tmp_path):
    """compare(..., impl={"block_pool": cls}) for a class defined in a test; the report names its file."""
    cls = load_impl("block_pool", str(learner_file(tmp_path, "block_pool", ("self.free_queue.prepend_n(to_front)",
                                                                            "self.free_queue.append_n(to_front)"))))
    r = compare_upstream("reimpl.paged_attn", "cmp_evict", impl={"block_pool": cls})
    assert r.exit_code == 1 and r.first.field.startswith("kv.")  # freed uncached blocks reused last, not first
    assert r.impl["block_pool"].endswith("my_block_pool_bug.py:BlockPool")


def test_a_wrong_kind_of_object_is_refused():
    with pytest.raises(TourError, match="is not a class"):
        check_impl("block_pool", lambda n: n)
    with pytest.raises(TourError, match="is not a function"):
        check_impl("paged_attention", COMPONENTS["block_pool"].reference_object())


# --- the registry and the interface docs -----------------------------------------------------


def test_every_module_runs_known_components_whose_references_offer_the_interface():
    for m in MODULES.values():
        assert set(m.components) <= set(COMPONENTS), m.name
        if m.triton:
            continue  # importing the kernel needs the Triton interpreter: tests/test_compare_triton.py runs it
        for name, ref in m.components.items():
            module, obj = ref.split(":")
            check_impl(name, getattr(__import__(module, fromlist=[obj]), obj))


def test_component_notes_exist_in_the_annotations():
    ids = {n["id"] for f in (ROOT / "annotations").glob("*.toml") for n in tomllib.loads(f.read_text()).get("note", [])}
    for c in COMPONENTS.values():
        assert c.notes and set(c.notes) <= ids, (c.name, set(c.notes) - ids)


def test_a_crash_in_the_learners_file_is_located_there(compare_upstream, tmp_path):
    bug = learner_file(tmp_path, "scheduler", ("return min(num_wanted, token_budget)",
                                               "return num_wanted if num_wanted <= token_budget else 1 // 0"))
    r = compare_upstream("reimpl.chunked_prefill", "cmp_chunked", impl={"scheduler": str(bug)})
    assert (r.first.step, r.first.field) == (1, "reimpl.exception")
    assert "ZeroDivisionError" in r.first.reimpl and f"{bug.name}:" in r.first.message and "in chunk" in r.first.message


def test_the_gpu_runner_reads_the_registry_without_pydantic_or_torch():
    script = ("import sys\n"
              "for m in ('pydantic', 'libcst', 'torch'): sys.modules[m] = None  # absent on the GPU image before assembly\n"
              "from vllm_tour.gpu import runner\n"
              "print(','.join(runner.MODULES))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == ",".join(name for name, m in MODULES.items() if m.world_size == 1 and not m.moe_only)
