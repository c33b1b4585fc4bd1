"""The GPU runner's pure-Python parts (CI is CPU-only; the runner itself runs on the H200)."""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from vllm_tour.gpu import runner
from vllm_tour.gpu.runner import first_difference, logprobs_close, make_tour_dist, pack, step_timeout

REPO = Path(__file__).resolve().parents[1]


def test_step_timeout_respects_limit_and_deadline():
    t0 = 1000.0
    assert step_timeout("trace", t0, 540, now=t0) == runner.STEP_LIMITS["trace"]
    # 500 s gone of 540: 40 left, minus the packing reserve
    assert step_timeout("race", t0, 540, now=t0 + 500) == 40 - runner.RESERVE_S
    assert step_timeout("race", t0, 540, now=t0 + 600) == 0.0
    assert step_timeout("pack", t0, 540, now=t0 + 530) == 10  # the reserve is pack's


def test_tour_dist_exposes_the_probe_plugin(tmp_path):
    make_tour_dist(tmp_path)
    dists = [d for d in md.distributions(path=[str(tmp_path)]) if d.metadata["Name"] == "vllm-tour"]
    assert len(dists) == 1
    eps = [e for e in dists[0].entry_points if e.group == "vllm.general_plugins"]
    assert [e.value for e in eps] == ["vllm_tour.probes.plugin:register"]
    assert eps[0].load().__module__ == "vllm_tour.probes.plugin"


def test_pack_keeps_runs_and_drops_captures_when_too_big(tmp_path):
    run = tmp_path / "traces" / "single"
    (run / "captures").mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    (run / "captures" / "step-0001.rank0.safetensors").write_bytes(os.urandom(200_000))
    info = pack(tmp_path, [run])
    with tarfile.open(tmp_path / "traces.tar.gz") as tf:
        names = tf.getnames()
    assert "single/meta.json" in names and any("captures" in n for n in names) and not info["captures_dropped"]
    info = pack(tmp_path, [run], max_bytes=50_000)
    with tarfile.open(tmp_path / "traces.tar.gz") as tf:
        names = tf.getnames()
    assert info["captures_dropped"] and names == ["single/meta.json"]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_logprobs_rule_vllm_style():
    up, re_ = [5, 6, 7, 8], [5, 6, 9, 1]
    top_up = [[5], [6], [7, 9, 1, 2, 3], [8]]
    top_re = [[5], [6], [9, 7, 4, 2, 3], [1]]
    r = logprobs_close(up, re_, top_up, top_re)
    assert r["ok"] and r["first_diff"] == 2  # each in the other's top-5; later tokens not judged
    r = logprobs_close(up, re_, top_up, [[5], [6], [9, 4, 2, 3, 0], [1]])
    assert not r["ok"] and not r["upstream_in_reimpl_top"] and r["reimpl_in_upstream_top"]
    assert logprobs_close(up, up, top_up, top_up) == {"ok": True, "identical": True, "first_diff": None}
    assert not logprobs_close(up, up[:3], top_up, top_up)["ok"]


def test_plan_names_every_step_and_scenario():
    a = runner.build_parser().parse_args(["all", "--out", "/tmp/x"])
    cmds = runner.step_commands(a)
    assert set(cmds) == set(runner.STEPS + runner.OPTIONAL_STEPS) - {"pack"}
    assert cmds["doctor"][-2:] == ["--pin", "v0.21.0"]
    trace = " ".join(cmds["trace"])
    assert all(s in trace for s in runner.TRACE_SCENARIOS + runner.COMPARE_SCENARIOS)
    assert "TRITON_ATTN" in trace
    assert all(m in " ".join(cmds["compare"]) for m in runner.MODULES)
    for name in runner.TRACE_SCENARIOS + runner.COMPARE_SCENARIOS:
        assert (REPO / "traces" / "scenarios" / f"{name}.toml").is_file()


def test_tokens_step_runs_the_reimpl_at_the_pin():
    """The fast engine in the tokens step follows the pin's policies (free_policy), so it is told the pin."""
    cmds = runner.step_commands(runner.build_parser().parse_args(["all", "--out", "/tmp/x", "--pin", "v0.32.0"]))
    assert runner.build_parser().parse_args(cmds["tokens"][3:]).pin == "v0.32.0"


def test_unknown_step_is_refused():
    with pytest.raises(SystemExit):
        runner.main(["all", "--steps", "trace,bogus", "--out", "/tmp/x"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cuda_run_stops_while_parts_are_missing(tmp_path):
    """Runs 1-3: assemble.sh exits 3 (parts missing) and so must the wrapper, before any step runs."""
    (tmp_path / ".gpu" / "cuda").mkdir(parents=True)
    (tmp_path / ".gpu" / "cuda" / "assemble.sh").write_text("echo staged; exit 3\n")
    (tmp_path / "vllm_tour" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "vllm_tour" / "gpu" / "cuda_run.sh", tmp_path / "vllm_tour" / "gpu")
    p = subprocess.run(["bash", "vllm_tour/gpu/cuda_run.sh"], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path / "out")))
    assert p.returncode == 3
    assert "assemble rc=3" in p.stdout and "staged" in p.stdout


def test_archive_leaves_captures_out_and_stays_under_the_cap(tmp_path):
    """What comes back is one file of at most 16 MiB: captures never go in; if still too big, the biggest
    files are left out and ARCHIVE.json says which."""
    out = tmp_path / "out"
    run = out / "traces" / "cmp_single"
    (run / "captures").mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    (run / "captures" / "step-0001.rank0.safetensors").write_bytes(os.urandom(300_000))
    (out / "compare-reimpl_paged_attn.json").write_text("[]")
    (out / "traces.tar.gz").write_bytes(os.urandom(1000))
    (out / "log").write_text("the log stays beside the archive")
    info = runner.archive(out)
    assert sorted(p.name for p in out.iterdir()) == ["log", "results.tar.gz"]
    with tarfile.open(out / "results.tar.gz") as tf:
        names = tf.getnames()
        meta = __import__("json").loads(tf.extractfile("ARCHIVE.json").read())
    assert "traces/cmp_single/meta.json" in names and "compare-reimpl_paged_attn.json" in names
    assert not any("captures" in n for n in names) and "traces.tar.gz" not in names and "log" not in names
    assert meta["captures_left_out"] == 1 and info["too_big_left_out"] == [] and info["bytes"] < runner.ARCHIVE_MAX_BYTES

    (out / "big.bin").write_bytes(os.urandom(120_000))  # random bytes do not compress
    (out / "small.json").write_text("{}")
    info = runner.archive(out, max_bytes=60_000)
    with tarfile.open(out / "results.tar.gz") as tf:
        names = tf.getnames()
    assert info["bytes"] <= 60_000 and "small.json" in names and "big.bin" not in names
    assert info["too_big_left_out"][0].startswith("big.bin")


def test_triton_f32_reaches_every_step_and_trace_scenarios_are_traced_once():
    a = runner.build_parser().parse_args(["all", "--out", "/tmp/x", "--triton-f32", "ieee", "--trace-scenarios",
                                          "single,shared_prefix", "--compare-scenarios", "cmp_single,shared_prefix"])
    assert runner.step_env({"PATH": "/bin"}, a.triton_f32)["TRITON_F32_DEFAULT"] == "ieee"
    assert "TRITON_F32_DEFAULT" not in runner.step_env({}, None)
    cmd = runner.step_commands(a)["trace"]
    assert cmd[cmd.index("--scenarios") + 1] == "single,shared_prefix,cmp_single"
    with pytest.raises(SystemExit):
        runner.build_parser().parse_args(["all", "--triton-f32", "fp64"])


def test_triton_f32_is_recorded_in_the_run_env(monkeypatch):
    from vllm_tour.engine.run import env_allow_list

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert env_allow_list()["TRITON_F32_DEFAULT"] == "ieee"


def test_tp_variants_override_the_scenario_engine():
    """tp_chunked+bf16 is tp_chunked in bfloat16, tp_single+tp1 the same requests at TP=1; unknown tags refused."""
    sc = runner._scenario("tp_chunked+bf16")
    base = runner._scenario("tp_chunked")
    assert (sc.engine.dtype, base.engine.dtype) == ("bfloat16", "float32")
    assert sc.requests == base.requests and sc.engine.tensor_parallel_size == 2
    assert runner._scenario("tp_single+tp1").engine.tensor_parallel_size == 1
    with pytest.raises(SystemExit):
        runner.main(["all", "--out", "/tmp/x", "--steps", "pack", "--compare-scenarios", "tp_single+fp8"])


def test_step_limits_override_and_nccl_multicast_stays_off():
    assert runner.parse_limits("trace=400,compare=200") == {"trace": 400.0, "compare": 200.0}
    assert runner.step_timeout("trace", 0.0, 540, now=0.0, limits={"trace": 400.0}) == 400.0
    for bad in ("trace", "bogus=3", "trace=x"):
        with pytest.raises(SystemExit):
            runner.parse_limits(bad)
    assert runner.step_env({}, None)["NCCL_NVLS_ENABLE"] == "0"


def test_max_abs_by_kind_pools_ranks_layers_and_steps():
    t = lambda name, m, ok=True: {"name": name, "max_abs": m, "ok": ok}  # noqa: E731
    got = runner.max_abs_by_kind([t("rank0/tp.all_reduce_out.model.layers.0.mlp.down_proj", 1e-6),
                                  t("rank1/tp.all_reduce_out.model.layers.1.mlp.down_proj", 3e-6, False),
                                  t("rank0/tp.all_reduce_in.model.layers.0.self_attn.o_proj", 2e-6),
                                  t("rank0/tp.all_gather_out.logits", 5e-5),
                                  t("rank0/moe_partial.layers.0", 4e-6), t("rank1/moe_partial.layers.1", 1e-6)])
    assert got == {"all_gather_out.logits": {"max_abs": 5e-5, "n": 1, "out_of_tolerance": 0},
                   "moe_partial": {"max_abs": 4e-6, "n": 2, "out_of_tolerance": 0},
                   "all_reduce_in.o_proj": {"max_abs": 2e-6, "n": 1, "out_of_tolerance": 0},
                   "all_reduce_out.down_proj": {"max_abs": 3e-6, "n": 2, "out_of_tolerance": 1}}


def test_flash_variant_wins_over_the_runs_backend():
    """One run traces qwen3_06b_hello on both backends: +flash keeps FLASH_ATTN whatever --attention-backend says."""
    assert runner.trace_scenario("qwen3_06b_hello+bf16", "TRITON_ATTN").engine.attention_backend == "TRITON_ATTN"
    sc = runner.trace_scenario("qwen3_06b_hello+bf16+flash", "TRITON_ATTN")
    assert (sc.engine.attention_backend, sc.engine.dtype, sc.engine.load_format) == ("FLASH_ATTN", "bfloat16", "dummy")
    assert runner.trace_scenario("single", None).engine.attention_backend is None  # the pin's default


def test_carried_models_become_every_steps_model_cache(tmp_path, monkeypatch):
    """carry-models copies Qwen3-0.6B's built directory (tokenizer included) under its content-keyed name; with the
    folder present, every step's VLLM_TOUR_CACHE points at it, where resolve_model finds it."""
    from vllm_tour.upstream.models import dummy_model_dir

    out = tmp_path / "tour-cache"
    assert runner.main(["carry-models", "--out", str(out)]) == 0
    (carried,) = (out / "models").iterdir()
    assert (carried / "tokenizer.json").is_file() and (carried / "source.json").is_file()
    monkeypatch.setattr(runner, "CARRIED_CACHE", out)
    env = runner.step_env({}, None)
    assert env["VLLM_TOUR_CACHE"] == str(out)
    monkeypatch.setenv("VLLM_TOUR_CACHE", env["VLLM_TOUR_CACHE"])
    assert dummy_model_dir("Qwen3-0.6B") == carried
    monkeypatch.setattr(runner, "CARRIED_CACHE", tmp_path / "absent")
    assert "VLLM_TOUR_CACHE" not in runner.step_env({}, None)


def test_spec_group_names_every_spec_scenario_once(monkeypatch):
    """`--trace-scenarios spec` runs each speculative method's scenario, ngram_gpu (refused on CPU) first."""
    from vllm_tour.scenario import load_scenario

    seen = []
    monkeypatch.setattr(runner, "cmd_all", lambda a: seen.append(a) or 0)
    assert runner.main(["all", "--out", "/tmp/x", "--steps", "trace", "--trace-scenarios", "spec,spec_ngram",
                        "--compare-scenarios", ""]) == 0
    cmd = runner.step_commands(seen[0])["trace"]
    assert cmd[cmd.index("--scenarios") + 1] == ",".join(runner.SPEC_SCENARIOS)
    methods = [load_scenario(REPO / "traces" / "scenarios" / f"{n}.toml").engine.extra["speculative_config"]["method"]
               for n in runner.SPEC_SCENARIOS]
    assert methods[0] == "ngram_gpu" and len(set(methods)) == len(methods)


def test_spec_summary_counts_a_runs_drafts():
    from vllm_tour.paths import GOLDEN_DIR
    from vllm_tour.trace.reader import load_run

    run = load_run(GOLDEN_DIR / "spec_ngram")
    verified = [v for s in run.steps if s.spec_verify for v in s.spec_verify.requests]
    assert runner.spec_summary(GOLDEN_DIR / "spec_ngram") == {"spec": {
        "proposers": ["ngram"], "drafted": sum(len(v.draft_token_ids) for v in verified),
        "accepted": sum(v.num_accepted for v in verified)}}
    assert runner.spec_summary(GOLDEN_DIR / "single") == {}
