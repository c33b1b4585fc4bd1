"""Choose the CPU attention kernel's ISA (scenario `engine.cpu_attention_isa`).

Upstream picks it once per attention group in `cpu_attn._get_attn_isa`: "amx" for bf16 on
a CPU with AMX tiles, "vec16" for head sizes that are a multiple of 16 but not 32, else
"vec" on x86. The choice decides the KV-cache memory layout and the order of the kernel's
sums, so it differs between machines. Forcing it lets one machine trace both paths (the
AMX machine can run the "vec" kernel too). This is the one place vllm-tour changes an
upstream decision, and only when a scenario asks; every run records the ISA that ran
(AttentionRecord.isa).
"""

from __future__ import annotations

import functools
import os

from vllm_tour.errors import TourError

ISA_ENV = "VLLM_TOUR_CPU_ATTN_ISA"  # set by run_upstream from the scenario, read in every vLLM process
TARGET = "vllm.v1.attention.backends.cpu_attn._get_attn_isa"


def check(isa: str, dtype: str, backend: str | None) -> None:
    """Refuse, before any engine starts, an ISA this machine or this run cannot use."""
    import torch

    if backend != "CPU_ATTN":
        raise TourError(f"engine.cpu_attention_isa = {isa!r} needs the CPU_ATTN backend (this run uses {backend})")
    if isa == "amx":
        if not torch.cpu._is_amx_tile_supported():
            raise TourError("engine.cpu_attention_isa = 'amx' needs a CPU with AMX tiles (amx_tile in /proc/cpuinfo); "
                            "this one has none")
        if dtype != "bfloat16":
            raise TourError(f"engine.cpu_attention_isa = 'amx' runs bfloat16 only (scenario dtype {dtype})")


def install_override() -> None:
    """Wrap _get_attn_isa so that it returns the forced ISA while ISA_ENV is set (idempotent).

    The wrapper reads the variable at each call, so in a process that outlives the run
    (tests, in-process runs) upstream's own choice comes back when the variable goes."""
    if not os.environ.get(ISA_ENV):
        return
    from vllm.v1.attention.backends import cpu_attn

    if getattr(cpu_attn._get_attn_isa, "_vllm_tour_forced", False):
        return
    upstream_choice = cpu_attn._get_attn_isa

    @functools.wraps(upstream_choice)
    def _get_attn_isa(*args, **kwargs):
        return os.environ.get(ISA_ENV) or upstream_choice(*args, **kwargs)

    _get_attn_isa._vllm_tour_forced = True
    cpu_attn._get_attn_isa = _get_attn_isa
