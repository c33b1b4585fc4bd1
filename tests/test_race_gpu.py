"""The race's orchestration (vllm_tour/bench/race_gpu.py) on the CPU: which sides, in what order, under what
deadline, and which ratios make the headline. The sides themselves need the H200 (and upstream's CUDA engine);
their figures are under traces/results/."""

from __future__ import annotations

import json

import pytest

from vllm_tour.bench import race_gpu
from vllm_tour.bench.race_gpu import SIDES, headline, parse_sides, ratios, side_command, side_timeout
from vllm_tour.gpu import runner


def _res(**tps):
    return {name.replace("_", "-"): {"tok_per_s": v} for name, v in tps.items()}


def test_sides_parse_in_the_order_given_and_name_upstream_backends():
    sides = parse_sides("reimpl-graphs, upstream-fa-graphs,upstream-triton-eager,reimpl-graphs")
    assert [s.name for s in sides] == ["reimpl-graphs", "upstream-fa-graphs", "upstream-triton-eager"]
    fa = side_command(sides[1], 256)
    assert fa[fa.index("--backend") + 1] == "FLASH_ATTN" and "graphs" in fa and "vllm_tour.bench.race_upstream" in fa
    assert side_command(sides[2], 8)[side_command(sides[2], 8).index("--backend") + 1] == "TRITON_ATTN"
    with pytest.raises(ValueError, match="upstream-fa-eager"):  # the message lists the known sides
        parse_sides("reimpl-graphs,upstream-graphs")


def test_default_order_puts_the_headline_sides_first():
    """A deadline cuts the last sides: upstream's default (FLASH_ATTN) and the reimpl, graphs then eager, come first."""
    assert list(SIDES)[:4] == ["upstream-fa-graphs", "reimpl-graphs", "upstream-fa-eager", "reimpl-eager"]
    assert {s.backend for s in SIDES.values() if s.engine == "upstream"} == {"FLASH_ATTN", "TRITON_ATTN"}


def test_headline_is_against_the_fastest_upstream_side_of_each_mode():
    res = _res(reimpl_graphs=20000.0, reimpl_eager=9000.0, upstream_fa_graphs=19000.0,
               upstream_triton_graphs=17000.0, upstream_fa_eager=5000.0, upstream_triton_eager=6000.0)
    h = headline(res)
    assert h["graphs"] == {"reimpl": "reimpl-graphs", "fastest_upstream": "upstream-fa-graphs", "ratio": 1.053}
    assert h["eager"]["fastest_upstream"] == "upstream-triton-eager" and h["eager"]["ratio"] == 1.5
    r = ratios(res)
    assert r["reimpl-graphs / upstream-triton-graphs"] == 1.176
    assert not any("graphs / upstream-fa-eager" in k or "eager / upstream-fa-graphs" in k for k in r)  # same mode only


def test_failed_sides_are_left_out_of_the_ratios():
    res = _res(reimpl_graphs=20000.0, upstream_triton_graphs=17000.0)
    res["upstream-fa-graphs"] = {"error": "timed out after 200 s"}
    assert headline(res) == {"graphs": {"reimpl": "reimpl-graphs", "fastest_upstream": "upstream-triton-graphs",
                                        "ratio": 1.176}}
    assert headline({"reimpl-eager": {"error": "exit 1"}}) == {}


def test_side_timeout_follows_the_deadline():
    assert side_timeout(240.0, 0.0, None, now=1000.0) == 240.0
    assert side_timeout(240.0, 0.0, 400.0, now=100.0) == 240.0
    assert side_timeout(240.0, 0.0, 400.0, now=300.0) == 100.0
    assert side_timeout(240.0, 0.0, 400.0, now=400.0 - race_gpu.MIN_SIDE_S + 1) == 0.0


def test_runner_gives_the_race_its_deadline_and_keeps_what_ran(tmp_path):
    """`runner all --steps race`: the race gets the step's limit (less a margin) as --deadline-s and writes a
    self-describing race.json. With 60 s overall the race's own deadline leaves less than MIN_SIDE_S for its
    side, which is skipped and reported (not started, not silently dropped)."""
    rc = runner.main(["all", "--steps", "race", "--out", str(tmp_path), "--deadline-s", "60",
                      "--race-sides", "reimpl-graphs"])
    assert rc == 1  # a side that did not run is a failed race step
    race = json.loads((tmp_path / "race.json").read_text())
    race_deadline = 60 - runner.RESERVE_S - runner.RACE_MARGIN_S
    assert race_deadline < race_gpu.MIN_SIDE_S
    assert f"--deadline-s {race_deadline}" in race["command"]
    assert race["sides"] == {"reimpl-graphs": {"engine": "reimpl", "mode": "graphs", "backend": "reimpl/triton_attn.py"}}
    assert race["results"]["reimpl-graphs"]["error"].startswith("skipped") and race["headline"] == {}
    assert {"date", "gpu", "nvidia_smi", "throughput", "recipe"} <= set(race)


def test_runner_refuses_unknown_race_sides():
    with pytest.raises(SystemExit, match="bad --race-sides"):
        runner.main(["all", "--steps", "race", "--out", "/tmp/x", "--race-sides", "upstream-graphs"])
