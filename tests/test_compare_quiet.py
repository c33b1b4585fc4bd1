"""`compare` runs upstream in its own process, like `trace`: vLLM's INFO lines must not bury the report.

Measured with `compare reimpl.paged_attn --scenario cmp_single.toml --fresh`: 55 stdout lines (19 of
them vLLM INFO lines) before, 22 and none after. Starting an engine here to show it again would cost
a minute, so this checks the switch that does it: vLLM reads VLLM_LOGGING_LEVEL once, when imported,
and compare must set it before anything imports vLLM.
"""

import os

import pytest
from rich.console import Console

from vllm_tour.compare.command import run_compare
from vllm_tour.errors import TourError


def test_compare_sets_vllm_quiet_before_vllm_is_imported(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    with pytest.raises(TourError):
        run_compare("reimpl.nope", None, False, False, None, False, None, None, Console())
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
