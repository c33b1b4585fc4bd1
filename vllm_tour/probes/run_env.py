"""Which run this process belongs to, as the driver told it through the environment.

run_upstream sets these before the engine starts; every vLLM process (front end, EngineCore, workers)
inherits them, and the probes read them there to pick the declarations of the pin, backend and TP size.
"""

from __future__ import annotations

import os

from vllm_tour.trace.levels import LEVEL_ENV

PIN_ENV = "VLLM_TOUR_PIN"
BACKEND_ENV = "VLLM_TOUR_ATTN_BACKEND"  # set by run_upstream: the attention backend the engine runs
PLATFORM_ENV = "VLLM_TOUR_PLATFORM"  # a platform plugin's name (maca), overriding what is installed
TP_ENV = "VLLM_TOUR_TP_SIZE"  # set by run_upstream: the run's tensor_parallel_size (unset: not known)
SERVE_ENV = "VLLM_TOUR_SERVE"  # "1" in a `vllm-tour serve` run: the front-end probes are installed too

def current_pin() -> str:
    from vllm_tour.upstream.pins import DEFAULT_PIN

    return os.environ.get(PIN_ENV) or DEFAULT_PIN


def current_backend(pin: str) -> str | None:
    from vllm_tour.upstream import pins

    return os.environ.get(BACKEND_ENV) or pins.pin_profile(pin).default_attention_backend


def current_level() -> str:
    return os.environ.get(LEVEL_ENV) or "full"


def current_tp_size() -> int | None:
    return int(os.environ[TP_ENV]) if os.environ.get(TP_ENV) else None


def serving() -> bool:
    return os.environ.get(SERVE_ENV) == "1"
