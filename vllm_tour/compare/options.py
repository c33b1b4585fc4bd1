"""Which upstream engine options a comparison can honour: carried into the reimpl's EngineConfig,
neutral (they change nothing compare judges), or refused.

A scenario's `[engine.extra]` reaches upstream's EngineArgs as given (engine.run.extra_engine_args).
An option upstream runs with and the reimpl runs without makes an unmodified reimpl look wrong, so
every extra option must be on this allow-list; any other is refused (exit 2) before an engine starts.
The typed `[engine]` fields are honoured elsewhere: read back from upstream's records (block size,
pool, token budget, prefix caching), or checked by reimpl_side.applicable (TP, EP, dtype).

To carry a new option: implement upstream's rule in reimpl/ (an EngineConfig field), add it to
CARRIED, and add a scenario that exercises it to tests/test_compare_options.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vllm_tour.errors import TourError


@dataclass(frozen=True)
class Carried:
    field: str  # reimpl.config.EngineConfig's field
    upstream: str  # where upstream applies it (v0.32.0)
    check: Callable[[Any], bool] = lambda v: True  # the values the reimpl's rule covers


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bool(v) -> bool:
    return isinstance(v, bool)


# The speculative decoding the reimpl runs (reimpl/spec_decode.py): ngram, every field given.
NGRAM_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}


def _ngram(v) -> bool:
    return (isinstance(v, dict) and set(v) == NGRAM_FIELDS and v["method"] == "ngram"
            and all(_int(v[k]) and v[k] > 0 for k in NGRAM_FIELDS - {"method"}))


CARRIED: dict[str, Carried] = {
    "long_prefill_token_threshold": Carried(
        "long_prefill_token_threshold", "vllm.v1.core.sched.scheduler.Scheduler.schedule (num_new_tokens capped)", _int),
    "long_prefill_token_threshold_adaptive": Carried(
        "long_prefill_token_threshold_adaptive", "vllm.v1.core.sched.scheduler.Scheduler.schedule (fair-share floor)",
        _bool),
    "enable_chunked_prefill": Carried(
        "enable_chunked_prefill", "vllm.v1.core.sched.scheduler.Scheduler.schedule (waiting loop stops)", _bool),
    "scheduler_reserve_full_isl": Carried(
        "reserve_full_sequence", "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots (full_sequence_must_fit)",
        _bool),
    "speculative_config": Carried(
        "speculative_config", "vllm.config.SpeculativeConfig (the drafter, Scheduler.schedule, update_from_output)",
        _ngram),
}

# option -> (the values that change nothing compare judges, why)
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "async_scheduling": (lambda v: v is False,
                         "false only: the synchronous loop the reimpl runs (true: decisions one step ahead)"),
}


def check_extra(extra: dict[str, Any], where: str = "engine.extra") -> None:
    """TourError naming the first option (in the scenario's order) the reimpl cannot honour."""
    for name, value in extra.items():
        if name in CARRIED:
            if not CARRIED[name].check(value):
                what = {_int: "a non-negative integer", _bool: "true or false",
                        _ngram: f"method ngram with positive {', '.join(sorted(NGRAM_FIELDS - {'method'}))}"}
                raise TourError(f"{where}.{name} = {value!r}: compare carries this option into the reimpl only for "
                                f"{what[CARRIED[name].check]}")
            continue
        if name in NEUTRAL:
            ok, why = NEUTRAL[name]
            if not ok(value):
                raise TourError(f"{where}.{name} = {value!r}: the reimpl cannot run with it ({name}: {why})")
            continue
        from vllm_tour.engine.run import engine_arg_names  # read from vLLM's source: no import of vLLM

        if name not in engine_arg_names():
            raise TourError(f"{where}.{name}: the installed vLLM's EngineArgs has no field {name!r}")
        raise TourError(f"{where}.{name}: upstream would run with this option and the reimpl cannot carry it, so "
                        f"compare refuses the scenario (carried: {', '.join(CARRIED)}; neutral: {', '.join(NEUTRAL)})")


def carried_config(engine_args: dict[str, Any]) -> dict[str, Any]:
    """{EngineConfig field: value} for the carried options upstream's run was given (its meta.json's
    engine_args, so a run given by path is honoured as it ran)."""
    return {c.field: engine_args[name] for name, c in CARRIED.items() if name in engine_args}
