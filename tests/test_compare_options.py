"""Engine options a scenario passes upstream through [engine.extra] (issue 30): each one compare carries into
the reimpl is compared clean against upstream on a scenario where it changes upstream's decisions; any other
is refused with exit 2, naming it, before an engine starts."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_tour.cli import app
from vllm_tour.compare import harness, options
from vllm_tour.compare import reimpl_side
from vllm_tour.compare.pytest_plugin import assert_matches_upstream
from vllm_tour.errors import TourError

DATA = Path(__file__).parent / "data" / "options"


def _scheduled(steps, step: int) -> dict[str, int]:
    return {r["req_id"]: r["num_scheduled_tokens"] for r in steps[step]["scheduler"]["scheduled"]}


# scenario -> what upstream did because of the option (else a clean compare would prove nothing)
def _long_prefill(steps):
    assert _scheduled(steps, 1) == {"long": 16, "short": 8}  # capped while "short" is there
    alone = [s for s in steps.values() if [r["req_id"] for r in s["scheduler"]["scheduled"]] == ["long"]
             and s["scheduler"]["scheduled"][0]["is_prefill"]]
    assert alone and alone[0]["scheduler"]["scheduled"][0]["num_scheduled_tokens"] > 16  # alone: no cap


def _adaptive(steps):
    assert _scheduled(steps, 1) == {"a": 32, "b": 32}  # max(8, 64 // 2)


def _no_chunking(steps):
    assert _scheduled(steps, 1) == {"a": 100}  # b (60) does not fit the 28 left and is not chunked
    assert _scheduled(steps, 2) == {"a": 1, "b": 60}


def _no_reserve(steps):
    assert _scheduled(steps, 1) == {"a": 40, "b": 24}  # b's first chunk fits the pool, its 100-token prompt would not


CARRIED = {"opt_long_prefill": _long_prefill, "opt_long_prefill_adaptive": _adaptive,
           "opt_no_chunked_prefill": _no_chunking, "opt_no_reserve_full": _no_reserve}


def test_allow_list_names_real_engine_args():
    from vllm_tour.engine.run import engine_arg_names

    assert set(options.CARRIED) | set(options.NEUTRAL) <= engine_arg_names()
    from reimpl.config import EngineConfig

    assert {c.field for c in options.CARRIED.values()} <= set(EngineConfig.__dataclass_fields__)


@pytest.mark.parametrize("name", sorted(CARRIED))
def test_carried_option_compared_clean(compare_upstream, upstream_run, monkeypatch, name):
    path = DATA / f"{name}.toml"
    CARRIED[name](upstream_run(path).steps)
    result = compare_upstream("reimpl.chunked_prefill", path)
    assert_matches_upstream(result)
    assert any(n.startswith("carried from upstream's engine args") for n in result.notes)
    # the same reimpl without the carry: the divergence issue 30 reported
    monkeypatch.setattr(reimpl_side, "carried_config", lambda args: {})
    assert compare_upstream("reimpl.chunked_prefill", path).exit_code == 1


@pytest.mark.parametrize("extra, named", [
    ("max_num_active_seqs = 2", "engine.extra.max_num_active_seqs: upstream would run with this option and the reimpl cannot carry it"),
    ("async_scheduling = true", "engine.extra.async_scheduling = True: the reimpl cannot run with it"),
    ("long_prefill_token_threshold = 1.5", "engine.extra.long_prefill_token_threshold = 1.5: compare carries"),
    ("no_such_option = 1", "engine.extra.no_such_option: the installed vLLM's EngineArgs has no field"),
])
def test_uncarried_option_refused_before_engine(tmp_path, monkeypatch, extra, named):
    sc = tmp_path / "s.toml"
    sc.write_text(f'name = "s"\n[engine.extra]\n{extra}\n[[requests]]\nid = "r"\ntoken_ids = [1, 2, 3]\nmax_tokens = 2\n')

    def no_engine(*a, **k):
        raise AssertionError("an engine started")

    monkeypatch.setattr(harness, "upstream_run_for", no_engine)
    res = CliRunner().invoke(app, ["compare", "reimpl.chunked_prefill", "--scenario", str(sc),
                                   "--json", str(tmp_path / "r.json")])
    assert isinstance(res.exception, TourError) and res.exception.exit_code == 2, res.output  # cli.main: exit 2
    assert named in str(res.exception)


def test_fixture_refuses_before_upstream_runs(tmp_path, compare_upstream, monkeypatch):
    sc = tmp_path / "s.toml"
    sc.write_text('name = "s"\n[engine.extra]\nmax_num_active_seqs = 2\n'
                  '[[requests]]\nid = "r"\ntoken_ids = [1, 2, 3]\nmax_tokens = 2\n')
    from vllm_tour.compare import pytest_plugin

    monkeypatch.setattr(pytest_plugin, "upstream_run_for", lambda *a, **k: pytest.fail("an engine started"))
    with pytest.raises(TourError, match="engine.extra.max_num_active_seqs: upstream would run with this option"):
        compare_upstream("reimpl.paged_attn", sc)


def test_refusal_is_one_line_exit_2(tmp_path, cli):
    sc = tmp_path / "s.toml"
    sc.write_text('name = "s"\n[engine.extra]\nmax_num_active_seqs = 2\n'
                  '[[requests]]\nid = "r"\ntoken_ids = [1, 2, 3]\nmax_tokens = 2\n')
    p = cli("compare", "reimpl.chunked_prefill", "--scenario", sc, "--json", tmp_path / "r.json", timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1
    assert p.stderr.startswith("error: scenario s: the reimpl cannot run it: engine.extra.max_num_active_seqs:")


def test_carried_threshold_judged_on_tensors_too(compare_upstream):
    """The capped chunks run through the model as upstream's did: attention outputs and KV blocks within fp32."""
    result = compare_upstream("reimpl.paged_attn", DATA / "opt_long_prefill.toml")
    assert_matches_upstream(result)
    assert result.tensors and {t.step for t in result.tensors} >= {1, 2}
