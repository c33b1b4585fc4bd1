"""Launching one Triton kernel many times per forward without Triton's per-call work.

Upstream counterpart: none in Python. Upstream's eager path launches its
elementwise kernels as C++ custom ops (`torch.ops._C.fused_add_rms_norm`, ...)
and its Triton attention through `kernel[grid](...)`; under CUDA graphs none
of this host work is repeated.

Why: `kernel[grid](*args)` binds and specialises every argument (is an integer
1 or divisible by 16, is a pointer 16-byte aligned), builds a cache key and
looks the compiled kernel up before it launches. On the H200 machine's CPU
that is ~23 us of host time per call against ~8 us for the launch itself
(`python -m vllm_tour.bench.eager_launch`). An
eager decode forward launches each kernel once per layer, 28 times, with
arguments of the same kinds: the same integers and constexprs, tensors of the
same dtypes, every one freshly allocated and so 16-byte aligned. The first
call goes through Triton and keeps the compiled kernel it chose; the other 27
launch that kernel directly.

Under the Triton interpreter (the CPU tests), or with a launch hook installed
(a profiler), every call goes through Triton.
"""

from __future__ import annotations

import torch


class Launch:
    """`kernel[grid](*args, **constexprs, **options)` for every call, with the lookup done once.

    `args` are the kernel's leading (non-constexpr) parameters in order; `constexprs` must be the
    parameters after them, all of them. The caller promises that every call passes arguments of the
    same kinds as the first (see the module docstring)."""

    def __init__(self, kernel, grid: tuple[int, ...], options: dict | None = None, **constexprs):
        names = kernel.arg_names
        assert list(constexprs) == names[len(names) - len(constexprs) :], (names, list(constexprs))
        self.kernel, self.grid, self.options, self.constexprs = kernel, grid, options or {}, constexprs
        self.tail = tuple(constexprs.values())
        self.grid3 = (tuple(grid) + (1, 1))[:3]
        self.compiled = None

    def __call__(self, *args) -> None:
        c = self.compiled
        if c is None:
            c = self.kernel[self.grid](*args, **self.constexprs, **self.options)
            # The interpreter returns no compiled kernel; a launch hook wants Triton's own path.
            if getattr(c, "function", None) is not None and not _launch_hooked():
                self.compiled, self.stream = c, torch.cuda.current_stream().cuda_stream
            return
        c.run(*self.grid3, self.stream, c.function, c.packed_metadata, None, None, None, *args, *self.tail)


def _launch_hooked() -> bool:
    """Whether a launch hook is installed (a profiler). Triton 3.x keeps them in `knobs.runtime`, as a chain
    of callables that is empty when nobody listens."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)
