"""The shared scenario model: canonical files load; every problem is one TourError line."""

import pytest

from vllm_tour.errors import TourError
from vllm_tour.paths import SCENARIOS_DIR
from vllm_tour.scenario import load_scenario

CANONICAL = ["single", "concurrent8", "shared_prefix", "preemption", "chunked_prefill", "tp2"]


@pytest.mark.parametrize("name", CANONICAL)
def test_canonical_scenarios_load(name):
    sc = load_scenario(SCENARIOS_DIR / f"{name}.toml")
    assert sc.name == name and sc.requests and sc.model == "tiny-qwen3"


@pytest.mark.parametrize(
    "text, message",
    [
        ("name = ", "malformed TOML"),
        ('name = "x"\n[[requests]]\nid = "a"\n', "give exactly one of prompt or token_ids"),
        ('name = "x"\n[engine]\nblock_size = 16\n[[requests]]\nid = "a"\nprompt = "p"\n', "multiple of 32"),
        ('name = "x"\n[[requests]]\nid = "a"\nprompt = "p"\n[[requests]]\nid = "a"\nprompt = "q"\n', "duplicate request ids: a"),
        ('name = "x"\nbogus = 1\n[[requests]]\nid = "a"\nprompt = "p"\n', "bogus"),
    ],
)
def test_bad_scenarios_are_one_line_errors(tmp_path, text, message):
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(TourError, match=message) as e:
        load_scenario(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_missing_scenario_file(tmp_path):
    with pytest.raises(TourError, match="does not exist"):
        load_scenario(tmp_path / "nope.toml")
