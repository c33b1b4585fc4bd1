"""The mini engine: add requests, then step -- schedule, run the model, sample, update.

Upstream counterparts (v0.32.0):
- `vllm.v1.engine.core.EngineCore.step` (schedule -> execute_model -> update_from_output)
- `vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs` (flatten the
  batch: input ids, positions, query_start_loc, seq_lens, slot mapping,
  logits indices), as used by `vllm.v1.worker.cpu_model_runner.CPUModelRunner`

A Qwen3-MoE checkpoint runs as moe.Qwen3MoE, its MoE blocks through the `moe` component
(moe.moe_block; ep.expert_parallel_moe splits the experts over simulated ranks); each step then
also writes one MoERecord per layer and rank.

Every step emits trace records shaped like vllm-tour's trace schema
(`vllm_tour.trace.schema`: SchedulerRecord, KVRecord, RunnerRecord) as plain
dicts with proc.role = "reimpl", so `vllm-tour compare` diffs like with like.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from .block_pool import BlockPool
from .chunked_prefill import Scheduler, SchedulerOutput
from .kv_cache_manager import KVCacheManager
from . import paged_attn
from .moe import Qwen3MoE, is_moe, moe_block
from .paged_attn import BatchMeta
from .qwen3 import Qwen3
from .request import Request
from .sampler import Sampler


@dataclass
class EngineConfig:
    model_dir: str
    block_size: int = 32
    num_blocks: int = 64  # including the null block 0, as upstream counts num_gpu_blocks
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    reserve_full_sequence: bool = True  # upstream scheduler_reserve_full_isl
    # Free-queue order of freed blocks (block_pool.FREE_POLICIES): "uncached_to_front"
    # mirrors v0.32.0, "append_all" mirrors v0.21.0. Chosen per pin by the harness.
    free_policy: str = "uncached_to_front"
    dtype: str = "float32"  # or "bfloat16": weights, activations and the KV cache (see qwen3.py)
    # Round the softmax weights to bf16 before P·V, as upstream's AMX CPU kernel does
    # (paged_attn.paged_attention). Chosen by the harness from the ISA upstream recorded.
    bf16_attention_weights: bool = False


@dataclass
class RequestIn:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    arrival_step: int = 0  # added before schedule() call number arrival_step + 1
    eos_token_id: int | None = None


@dataclass
class StepResult:
    out: SchedulerOutput
    records: list[dict]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict = field(default_factory=dict)  # queues/budget/free list after schedule() (for --explain)


class Engine:
    """The engine loop around four swappable components (compare's `--impl` passes a learner's own):
    block_pool, kv_cache_manager and scheduler are classes, paged_attention the model's attention function."""

    def __init__(self, cfg: EngineConfig, model: Qwen3 | None = None, *, block_pool: type = BlockPool,
                 kv_cache_manager: type = KVCacheManager, scheduler: type = Scheduler,
                 paged_attention: Callable = paged_attn.paged_attention, moe: Callable = moe_block):
        self.cfg = cfg
        if cfg.bf16_attention_weights:
            paged_attention = partial(paged_attention, bf16_weights=True)
        if model is None and is_moe(json.loads(open(os.path.join(cfg.model_dir, "config.json")).read())):
            model = Qwen3MoE(cfg.model_dir, attention=paged_attention, dtype=cfg.dtype, moe=moe)
        self.model = model or Qwen3(cfg.model_dir, attention=paged_attention, dtype=cfg.dtype)
        self.kv = kv_cache_manager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.max_model_len,
                                   cfg.free_policy, block_pool_cls=block_pool)
        self.scheduler = scheduler(
            self.kv, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
            cfg.enable_chunked_prefill, cfg.reserve_full_sequence,
        )
        self.caches = self.model.new_kv_caches(cfg.num_blocks, cfg.block_size)
        self.sampler = Sampler()
        self.proc = {"role": "reimpl", "pid": os.getpid(), "rank": 0}
        # req_id -> tokens to use instead of sampling (compare forces upstream's
        # tokens for randomly sampled requests; see sampler.py)
        self.forced: dict[str, list[int]] = {}
        # record_topk = k > 0: at each sampled position keep the model's own greedy token and its
        # top-k token ids, even where a forced token is used (compare's bf16 rule; see
        # vllm_tour/compare/tokens.py). req_id -> one entry per output position.
        self.record_topk = 0
        self.greedy: dict[str, list[int]] = {}
        self.topk: dict[str, list[list[int]]] = {}
        self.current_step: StepResult | None = None

    # --- the loop ----------------------------------------------------------------

    def run(self, requests: list[RequestIn], capture: tuple[str, ...] = (), max_steps: int = 10_000, on_step=None) -> list[StepResult]:
        pending = sorted(requests, key=lambda r: r.arrival_step)
        results: list[StepResult] = []
        step = 0  # engine step calls so far (arrival_step counts these)
        while (pending or self.scheduler.has_unfinished()) and step < max_steps:
            # A request arrives before engine step number arrival_step; an idle
            # engine would not step at all, so then the next request arrives now.
            while pending and (pending[0].arrival_step <= step or not self.scheduler.has_unfinished()):
                r = pending.pop(0)
                self.scheduler.add_request(Request(
                    r.req_id, list(r.prompt_token_ids), r.max_tokens, r.temperature, r.seed,
                    r.eos_token_id, r.arrival_step,
                ))
            res = self.step(capture)
            results.append(res)
            if on_step:
                on_step(res)
            step += 1
        return results

    def step(self, capture: tuple[str, ...] = ()) -> StepResult:
        t0 = time.time()
        waiting_before, running_before = len(self.scheduler.waiting), len(self.scheduler.running)
        out = self.scheduler.schedule()
        freed, evicted = self.kv.block_pool.take_events()
        t1 = time.time()
        records = [self._scheduler_record(out, t1, t1 - t0, waiting_before, running_before),
                   self._kv_record(out, freed, evicted)]
        res = StepResult(out, records, {}, self.snapshot(out))
        self.current_step = res  # what is known of this step so far, should the model run fail
        sampled: dict[str, int] = {}
        if out.scheduled:
            runner, sampled, res.tensors = self._execute(out, capture)
            records.append(runner)
            records += self._moe_records(out.step)
        self.scheduler.update_from_output(out, sampled)
        return res

    def snapshot(self, out: SchedulerOutput) -> dict:
        """The scheduler's and pool's state right after schedule(): what --explain prints."""
        sched, pool = self.scheduler, self.kv.block_pool

        def row(r: Request) -> dict:
            return {"req_id": r.req_id, "status": r.status, "num_computed_tokens": r.num_computed_tokens,
                    "num_tokens": r.num_tokens, "num_preemptions": r.num_preemptions}

        return {
            "running": [row(r) for r in sched.running],
            "waiting": [row(r) for r in sched.waiting],
            "token_budget": out.token_budget,
            "budget_left": out.budget_left,
            "admission_stopped_by": out.admission_stop,
            "free_blocks": pool.num_free_blocks(),
            "free_queue_head": pool.free_queue.block_ids()[:16],
            "cached_blocks": sorted(b.block_id for blocks in pool.cached.values() for b in blocks.values()),
        }

    # --- the model runner --------------------------------------------------------------

    def prepare_inputs(self, out: SchedulerOutput):
        """Flatten the scheduled requests into one batch (upstream _prepare_inputs)."""
        input_ids, positions, qsl, seq_lens, tables, slots, logits_idx = [], [], [0], [], [], [], []
        for s in out.scheduled:
            req = self.scheduler.requests[s.req_id]
            start = s.num_computed_tokens  # first position computed this step
            pos = list(range(start, start + s.num_tokens))
            table = self.kv.block_ids(s.req_id)
            input_ids += req.all_token_ids[start : start + s.num_tokens]
            positions += pos
            slots += paged_attn.slot_mapping(table, pos, self.cfg.block_size)
            tables.append(table)
            seq_lens.append(start + s.num_tokens)
            qsl.append(qsl[-1] + s.num_tokens)
            logits_idx.append(qsl[-1] - 1)  # last token of each request
        return input_ids, positions, BatchMeta(qsl, seq_lens, tables, slots), logits_idx

    def _execute(self, out: SchedulerOutput, capture: tuple[str, ...]):
        input_ids, positions, meta, logits_idx = self.prepare_inputs(out)
        with torch.no_grad():
            hidden = self.model.forward(input_ids, positions, meta, self.caches)
            # upstream's sampler works on fp32 logits (the model's bf16 values, widened)
            logits = self.model.logits(hidden[torch.tensor(logits_idx)]).float()
        sampled: dict[str, int] = {}
        for i, s in enumerate(out.scheduled):
            req = self.scheduler.requests[s.req_id]
            # Only a request whose whole sequence is now computed gets a token;
            # a prefill chunk that stops short of the prompt end samples nothing.
            if s.num_computed_tokens + s.num_tokens < req.num_tokens:
                continue
            if self.record_topk:
                self.greedy.setdefault(s.req_id, []).append(int(torch.argmax(logits[i])))
                self.topk.setdefault(s.req_id, []).append(torch.topk(logits[i], self.record_topk).indices.tolist())
            forced = self.forced.get(s.req_id)
            if forced is not None and req.num_output_tokens < len(forced):
                sampled[s.req_id] = forced[req.num_output_tokens]
            else:
                sampled[s.req_id] = self.sampler.sample(s.req_id, logits[i], req.temperature, req.seed)
        tensors: dict[str, torch.Tensor] = {}
        for name in capture:
            if name.startswith("attn_out.layers."):
                tensors[name] = self.model.last_attn_out[int(name.rsplit(".", 1)[1])].clone()
            elif name.startswith("kv_blocks.layers."):
                # the blocks this step wrote into (ascending ids), upstream CPU layout
                written = sorted({slot // self.cfg.block_size for slot in meta.slot_mapping})
                tensors[name] = self.caches[int(name.rsplit(".", 1)[1])].blocks(written)
                tensors[name + "#block_ids"] = torch.tensor(written)
            elif name.startswith(("router_logits.layers.", "moe_out.layers.")):
                moe = self.model.last_moe[int(name.rsplit(".", 1)[1])]
                tensors[name] = (moe.routing.logits if name.startswith("router_logits") else moe.out).clone()
            elif name == "logits":
                tensors[name] = logits.clone()
        runner = {
            "kind": "runner", "step": out.step, "proc": self.proc,
            "num_tokens": len(input_ids),
            "req_ids": [s.req_id for s in out.scheduled],
            "num_scheduled_tokens": [s.num_tokens for s in out.scheduled],
            "input_ids": {"full": input_ids, "length": len(input_ids)},
            "positions": {"full": positions, "length": len(positions)},
            "query_start_loc": meta.query_start_loc,
            "seq_lens": meta.seq_lens,
            "slot_mapping": {"full": meta.slot_mapping, "length": len(meta.slot_mapping)},
            "logits_indices": logits_idx,
            "sampled_token_ids": {k: [v] for k, v in sampled.items()},
        }
        return runner, sampled, tensors

    # --- trace records --------------------------------------------------------------------

    def _scheduler_record(self, out: SchedulerOutput, now: float, dur: float, waiting_before: int, running_before: int) -> dict:
        sched = self.scheduler
        return {
            "kind": "scheduler", "step": out.step, "proc": self.proc, "time": now, "duration_s": dur,
            "waiting_before": waiting_before, "running_before": running_before,
            "waiting_after": len(sched.waiting), "running_after": len(sched.running),
            "token_budget": out.token_budget,
            "tokens_scheduled": sum(s.num_tokens for s in out.scheduled),
            "max_num_seqs": sched.max_num_seqs,
            "scheduled": [{
                "req_id": s.req_id, "kind": s.kind, "num_scheduled_tokens": s.num_tokens,
                "num_computed_tokens": s.num_computed_tokens, "num_prompt_tokens": s.num_prompt_tokens,
                "num_output_tokens": s.num_output_tokens,
                # upstream's prefill boundary: a resumed request replays its outputs too
                "is_prefill": s.num_computed_tokens < max(s.num_prompt_tokens, s.num_prompt_tokens + s.num_output_tokens - 1),
            } for s in out.scheduled],
            "preempted": [{
                "req_id": p.req_id, "reason": "allocate_slots returned None",
                "while_allocating_for": p.while_allocating_for, "num_tokens_requested": p.num_tokens_requested,
                "free_blocks_at_failure": p.free_blocks_at_failure, "freed_block_ids": p.freed_block_ids,
                "num_computed_tokens_lost": p.num_computed_tokens_lost,
            } for p in out.preempted],
            "finished": list(out.finished),
        }

    def _kv_record(self, out: SchedulerOutput, freed: list[int], evicted: list[int]) -> dict:
        pool = self.kv.block_pool
        return {
            "kind": "kv", "step": out.step, "proc": self.proc,
            "num_blocks": pool.num_blocks - 1, "block_size": self.cfg.block_size,
            "free_blocks": pool.num_free_blocks(), "usage": pool.usage(),
            "block_tables": self.kv.block_tables(),
            "allocated": {rid: ids for rid, ids in out.new_block_ids.items() if ids},
            "freed": freed, "evicted": evicted,
            "prefix_hits": [{"req_id": rid, "num_hit_tokens": n, "block_ids": ids}
                            for rid, (n, ids) in out.prefix_hits.items()],
            "prefix_caching": self.kv.enable_caching,
        }

    def _moe_records(self, step: int) -> list[dict]:
        """One schema.MoERecord per MoE layer and (simulated) rank, as upstream's probe writes them."""
        records = []
        for layer, moe in sorted(getattr(self.model, "last_moe", {}).items()):
            ids = moe.routing.ids.tolist()
            num_experts = moe.routing.logits.shape[1]
            per_expert = [sum(row.count(e) for row in ids) for e in range(num_experts)]
            for rank, part in enumerate(moe.ranks):
                records.append({
                    "kind": "moe", "step": step, "proc": {**self.proc, "rank": rank}, "layer": layer,
                    "num_tokens": len(ids), "num_experts": num_experts,
                    "num_local_experts": len(part.local_tokens_per_expert), "expert_map": part.expert_map,
                    "topk_ids": ids, "topk_weights": moe.routing.weights.tolist(),
                    "tokens_per_expert": per_expert, "local_tokens_per_expert": part.local_tokens_per_expert,
                    "kernel": getattr(self.model.moe, "__name__", type(self.model.moe).__name__),
                })
        return records

    def outputs(self) -> dict[str, list[int]]:
        return {rid: list(r.output_token_ids) for rid, r in self.scheduler.requests.items()}
