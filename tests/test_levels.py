"""Trace levels: a lower level's records are the higher level's with whole record kinds left out, and the
views and commands that need more say so in one line. One scenario (it preempts) recorded at each level."""

import pytest

from vllm_tour.errors import TourError
from vllm_tour.trace.reader import load_run

VOLATILE = {"time", "duration_s", "proc"}  # wall clock and process ids differ from run to run


@pytest.fixture(scope="module")
def runs(trace_runs):
    # full first: its wrappers stay installed in this process (installs are idempotent), and the lower
    # levels' runs after it must still record only their own kinds
    full = load_run(trace_runs.get("preemption"))
    return {lv: load_run(trace_runs.get("preemption", level=lv)) for lv in ("steps", "blocks")} | {"full": full}


def test_each_run_says_its_level(runs):
    assert {lv: r.meta.level for lv, r in runs.items()} == {"steps": "steps", "blocks": "blocks", "full": "full"}


def test_lower_levels_are_a_subset_of_full_with_the_same_values(runs):
    full = runs["full"]
    assert any(s.scheduler.preempted for s in full.steps)  # the case that makes the scheduler record rich
    for lv in ("steps", "blocks"):
        run = runs[lv]
        assert [s.index for s in run.steps] == [s.index for s in full.steps]
        for s, f in zip(run.steps, full.steps):
            assert s.scheduler.model_dump(exclude=VOLATILE) == f.scheduler.model_dump(exclude=VOLATILE)
            assert not s.runner and not s.attention and not s.captures
            if lv == "blocks":
                assert s.kv.model_dump(exclude=VOLATILE) == f.kv.model_dump(exclude=VOLATILE)
            else:
                assert s.kv is None
        assert not run.errors
    assert all(s.kv and s.runner and s.attention for s in full.steps)


def test_views_name_the_level_to_record_again_with(runs, cli):
    out = cli("show", str(runs["steps"].path), "--step", "2")
    assert out.returncode == 0, out.stderr
    assert "block tables, KV pool, prefix-cache hits: not recorded at level steps (record again with --level blocks)" in out.stdout
    assert "model runner inputs, attention metadata: not recorded at level steps (record again with --level full)" in out.stdout
    assert "KV free" not in out.stdout  # no empty column standing for data the run never had
    out = cli("show", str(runs["blocks"].path), "--step", "2")
    assert "not recorded at level blocks (record again with --level full)" in out.stdout
    assert "block tables after step 2" in out.stdout


def test_compare_refuses_a_run_below_full(runs):
    from vllm_tour.compare.upstream import load_upstream

    with pytest.raises(TourError, match="compare needs records of level full; .* was recorded at level blocks: "
                                        "record it again with --level full"):
        load_upstream(runs["blocks"].path)


def test_bad_level_and_capture_below_full_are_refused_before_the_engine(cli):
    out = cli("trace", "-r", "hi", "--level", "all")
    assert out.returncode == 2 and "--level 'all': choose one of steps, blocks, full" in out.stdout + out.stderr
    out = cli("trace", "-r", "hi", "--level", "blocks", "--capture", "attn_out")
    assert out.returncode == 2 and "--capture needs --level full" in out.stdout + out.stderr


def test_repro_records_what_its_expectations_need_and_refuses_less(cli):
    from vllm_tour.paths import SCENARIOS_DIR
    from vllm_tour.repro.reproduce import expectations_here, needed_level
    from vllm_tour.scenario import load_scenario

    ep = SCENARIOS_DIR / "repro_ep_tp2_cpu.toml"  # judged on each rank's expert map: MoE records, level full
    assert needed_level(expectations_here(load_scenario(ep), ep, "v0.32.0")) == "full"
    out = cli("repro", str(ep), "--level", "blocks")
    assert out.returncode == 2
    assert "--level blocks: repro_ep_tp2_cpu's expectations are judged on records of level full" in out.stdout + out.stderr
