"""Install every declared probe in this process (idempotent).

Called by the vLLM general plugin in each vLLM process when VLLM_TOUR_RUN_DIR
is set, and directly by `run_upstream` for in-process runs. `check_probes(pin)`
resolves every target without installing anything: `run_upstream` calls it
before starting an engine, so a target missing on the pin fails fast, by name.
"""

from __future__ import annotations

import os

from ..trace.writer import RECORDER
from . import attention, capture, kv, runner, scheduler
from .base import Probe, Resolved, install, resolve

PIN_ENV = "VLLM_TOUR_PIN"

# Order matters only for reading: scheduler side, then worker side.
PROBES: list[Probe] = [*scheduler.PROBES, *kv.PROBES, *runner.PROBES, *attention.PROBES, *capture.PROBES]


def current_pin() -> str:
    from ..pins import DEFAULT_PIN

    return os.environ.get(PIN_ENV) or DEFAULT_PIN


def check_probes(pin: str, probes: list[Probe] | None = None) -> list[Resolved]:
    """Resolve and signature-check every probe on `pin`; TourError names the first missing target."""
    return [resolve(p, pin) for p in (PROBES if probes is None else probes)]


def install_all(pin: str | None = None, probes: list[Probe] | None = None) -> int:
    """Resolve, check and install the probes; switch the recorder on from the environment."""
    resolved = check_probes(pin or current_pin(), probes)
    n = install(resolved, RECORDER)
    RECORDER.activate_from_env()
    return n
