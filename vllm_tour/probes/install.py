"""Install every declared probe in this process (idempotent).

Called by the vLLM general plugin in each vLLM process when VLLM_TOUR_RUN_DIR
is set, and directly by `run_upstream` for in-process runs. `check_probes(pin)`
resolves every target without installing anything: `run_upstream` calls it
before starting an engine, so a target missing on the pin fails fast, by name.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from vllm_tour.errors import TourError
from vllm_tour.probes import attention, capture, kv, maca, moe, runner, scheduler, server, spec_decode, tp
from vllm_tour.probes.base import Probe, Resolved, install, resolve
from vllm_tour.probes.run_env import PLATFORM_ENV, current_backend, current_level, current_pin, current_tp_size, serving
from vllm_tour.trace import levels
from vllm_tour.trace.writer import RECORDER

# Order matters only for reading: scheduler side, then worker side.
PROBES: list[Probe] = [*scheduler.PROBES, *spec_decode.PROBES, *kv.PROBES, *runner.PROBES, *attention.PROBES, *capture.PROBES, *tp.PROBES,
                      *moe.PROBES, *maca.PROBES, *server.PROBES]
PLATFORM_PACKAGES = {maca.PLATFORM: maca.PACKAGE}  # platform plugin -> the package it installs


@functools.cache
def current_platform() -> str | None:
    """The platform plugin whose backend classes the attention probes target: VLLM_TOUR_PLATFORM, else the one
    installed (found without importing it); None: upstream's own backends."""
    if os.environ.get(PLATFORM_ENV):
        return os.environ[PLATFORM_ENV]
    return next((name for name, pkg in PLATFORM_PACKAGES.items() if importlib.util.find_spec(pkg) is not None), None)


def probes_for(pin: str, backend: str | None = None, probes: list[Probe] | None = None,
               platform: str | None = None, tp_size: int | None = None, level: str = "full",
               serve: bool | None = False) -> list[Probe]:
    """The declarations that apply on `pin` with attention backend `backend` (default: the pin's),
    in a run of `tp_size` ranks (None: not known; 1 leaves the multi-rank probes out), recording at
    trace level `level` (a probe whose records the level does not keep is left out), served or not
    (`serve` False, the default, leaves the serve-only probes out; True needs them on `pin`; None, for
    listings: those declared for `pin`).

    Probes without a backend apply on every pin (resolve() then refuses a pin they
    were not checked against), except `own_pins_only` ones, which apply on their pins only.
    Backend-specific ones (attention, capture) are chosen by (platform, pin, backend): a platform
    plugin (maca) registers its own classes under upstream's backend names. A name with no
    declaration for all three is an error.
    """
    from vllm_tour.upstream import pins

    probes = PROBES if probes is None else probes
    profile = pins.pin_profile(pin)
    backend = backend or profile.default_attention_backend
    if backend not in profile.attention_backends:
        raise TourError(f"pin {pin} has probes for the attention backends {', '.join(profile.attention_backends)} "
                        f"(its profile in pins/{pin}.toml), not {backend}")
    probes = [p for p in probes if (not p.own_pins_only or pin in p.pins) and not (p.multi_rank and tp_size == 1)
              and levels.has(level, p.level)
              and not (p.serve_only and (serve is False or (serve is None and pin not in p.pins)))]
    out = [p for p in probes if p.backend is None or (p.backend == backend and pin in p.pins and p.platform == platform)]
    chosen = {p.name for p in out}
    for name in dict.fromkeys(p.name for p in probes if p.backend is not None and p.name not in chosen):
        have = ", ".join(f"{d.backend}{f' ({d.platform})' if d.platform else ''} on {'/'.join(d.pins)}"
                         for d in probes if d.name == name)
        on = f" of platform {platform}" if platform else ""
        raise TourError(f"probe {name}: no declaration for attention backend {backend}{on} on pin {pin} (declared: {have})")
    return out


def check_probes(pin: str, probes: list[Probe] | None = None, backend: str | None = None,
                 platform: str | None = None, tp_size: int | None = None, level: str = "full",
                 serve: bool | None = False) -> list[Resolved]:
    """Resolve and signature-check every probe on `pin`; TourError names the first missing target."""
    return [resolve(p, pin) for p in probes_for(pin, backend, probes, platform, tp_size, level, serve)]


def install_all(pin: str | None = None, probes: list[Probe] | None = None, backend: str | None = None) -> int:
    """Resolve, check and install the probes; switch the recorder on from the environment."""
    pin = pin or current_pin()
    resolved = check_probes(pin, probes, backend or current_backend(pin), current_platform(), current_tp_size(),
                            current_level(), serving())
    n = install(resolved, RECORDER)
    RECORDER.activate_from_env()
    return n
