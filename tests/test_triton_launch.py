"""reimpl/triton_launch.py: when a kernel may be launched without Triton's per-call path."""

from __future__ import annotations

import pytest
from triton import knobs

from reimpl import fused_ops
from reimpl.triton_launch import Launch, _launch_hooked


def test_an_installed_launch_hook_keeps_tritons_own_path():
    """Triton 3.x keeps launch hooks as a chain that is empty when nobody listens: empty is no hook; a
    profiler's hook in the chain sends every launch through Triton (which calls it)."""
    assert _launch_hooked() is False
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert _launch_hooked() is True
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


def test_constexprs_must_be_the_kernels_trailing_parameters():
    """The direct launch appends the constexprs after the call's arguments: any other order is refused."""
    Launch(fused_ops._silu_and_mul_kernel, (1,), BLOCK=1024)
    with pytest.raises(AssertionError):
        Launch(fused_ops._add_rms_norm_kernel, (1,), BLOCK=1024, HAS_RES=True)
