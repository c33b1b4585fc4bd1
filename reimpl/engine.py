"""The mini engine: add requests, then step -- schedule, run the model, sample, update.

Upstream counterparts (v0.32.0):
- `vllm.v1.engine.core.EngineCore.step` (schedule -> execute_model -> update_from_output)
- `vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs` (flatten the
  batch: input ids, positions, query_start_loc, seq_lens, slot mapping,
  logits indices), as used by `vllm.v1.worker.cpu_model_runner.CPUModelRunner`;
  the batch's row order is upstream's persistent batch order (input_batch.py)
- with a speculative_config: `GPUModelRunner.propose_draft_token_ids` and
  `EngineCore.post_step` (drafts proposed after the step, handed to the scheduler);
  spec_decode.py has the proposer, the verification and the scheduler's part

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
from .config import EngineConfig, RequestIn, admit_arrivals
from .input_batch import InputBatch
from .kv_cache_manager import KVCacheManager
from . import paged_attn
from .moe import Qwen3MoE, is_moe, moe_block
from .paged_attn import BatchMeta
from .qwen3 import Qwen3
from .request import Request
from .sampler import Sampler
from .spec_decode import NgramProposer, SpecDecodeScheduler, verify_greedy


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
            cfg.long_prefill_token_threshold, cfg.long_prefill_token_threshold_adaptive,
        )
        self.caches = self.model.new_kv_caches(cfg.num_blocks, cfg.block_size)
        self.sampler = Sampler()
        self.proposer = None
        if cfg.speculative_config:
            spec = cfg.speculative_config
            if spec.get("method") != "ngram" or not isinstance(self.scheduler, SpecDecodeScheduler):
                raise ValueError("speculative decoding here is ngram, with spec_decode.SpecDecodeScheduler")
            self.proposer = NgramProposer(spec["num_speculative_tokens"], spec["prompt_lookup_min"],
                                          spec["prompt_lookup_max"], cfg.max_model_len)
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
        self.input_batch = InputBatch()
        self.steps_done = 0
        # (step, what the engine is doing): the step it is in or about to start, and the decision or
        # phase ("schedule", "allocate_slots for r1", "model forward", "sample r1", ...). Should a
        # component raise, this says where (compare reports it); the traceback only says which line.
        self.where: tuple[int, str] = (1, "start")
        for name in ("get_computed_blocks", "allocate_slots", "free"):  # the scheduler's calls into the KV manager
            setattr(self.kv, name, self._tracked(name, getattr(self.kv, name)))

    def _tracked(self, name: str, method: Callable) -> Callable:
        def tracked_call(request, *args, **kwargs):
            step, phase = self.where
            self.where = (step, f"{name} for {request.req_id}")
            result = method(request, *args, **kwargs)
            self.where = (step, phase)
            return result

        return tracked_call

    # --- the loop ----------------------------------------------------------------

    def run(self, requests: list[RequestIn], capture: tuple[str, ...] = (), max_steps: int = 10_000, on_step=None) -> list[StepResult]:
        pending = sorted(requests, key=lambda r: r.arrival_step)
        results: list[StepResult] = []
        step = 0  # engine step calls so far (arrival_step counts these)
        while (pending or self.scheduler.has_unfinished()) and step < max_steps:
            self.where = (self.steps_done + 1, "add_request")
            admit_arrivals(pending, self.scheduler, step)
            res = self.step(capture)
            results.append(res)
            if on_step:
                on_step(res)
            step += 1
        return results

    def step(self, capture: tuple[str, ...] = ()) -> StepResult:
        t0 = time.time()
        n = self.steps_done + 1
        waiting_before, running_before = len(self.scheduler.waiting), len(self.scheduler.running)
        self.where = (n, "schedule")
        out = self.scheduler.schedule()
        freed, evicted = self.kv.block_pool.take_events()
        t1 = time.time()
        records = [self._scheduler_record(out, t1, t1 - t0, waiting_before, running_before),
                   self._kv_record(out, freed, evicted)]
        res = StepResult(out, records, {}, self.snapshot(out))
        self.current_step = res  # what is known of this step so far, should the model run fail
        sampled: dict[str, list[int]] = {}
        self.where = (n, "batch order")
        rows = self.input_batch.update(out.scheduled)  # upstream updates its batch on empty steps too
        if out.scheduled:
            runner, sampled, res.tensors = self._execute(out, rows, capture)
            records.append(runner)
            records += self._moe_records(out.step)
        if isinstance(self.scheduler, SpecDecodeScheduler):
            records += self._speculate(out, rows, sampled)
        else:  # the plain scheduler takes the one token each request sampled
            self.where = (n, "update_from_output")
            self.scheduler.update_from_output(out, {rid: tokens[0] for rid, tokens in sampled.items()})
        self.steps_done = n
        return res

    def _speculate(self, out: SchedulerOutput, rows: list[str], sampled: dict[str, list[int]]) -> list[dict]:
        """update_from_output with drafts: propose the next drafts (on the runner's tokens, before the
        scheduler's stop checks, as upstream's runner does), verify this step's, hand the scheduler the next."""
        n = out.step
        self.where = (n, "propose drafts")
        reqs = self.scheduler.requests
        proposed = self.proposer.propose({rid: reqs[rid].all_token_ids + sampled[rid] if rid in sampled else None
                                          for rid in rows}) if self.proposer else {}
        records = [self._spec_verify_record(out, sampled)] if out.scheduled_spec_decode_tokens else []
        self.where = (n, "update_from_output")
        self.scheduler.update_from_output(out, sampled)
        if self.proposer and out.scheduled:
            dropped = self.scheduler.update_draft_token_ids(proposed)
            records.append({"kind": "spec_proposal", "step": n, "proc": self.proc, "proposer": "ngram",
                            "proposed": proposed, "ignored": dropped})
        return records

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

    def prepare_inputs(self, batch: list, drafts: dict[str, list[int]]):
        """Flatten the scheduled requests (`Scheduled`s in batch order, each request's drafts after its known
        tokens) into one batch (upstream _prepare_inputs)."""
        input_ids, positions, qsl, seq_lens, tables, slots, logits_idx = [], [], [0], [], [], [], []
        for s in batch:
            req = self.scheduler.requests[s.req_id]
            start = s.num_computed_tokens  # first position computed this step
            pos = list(range(start, start + s.num_tokens))
            table = self.kv.block_ids(s.req_id)
            input_ids += (req.all_token_ids + drafts.get(s.req_id, []))[start : start + s.num_tokens]
            positions += pos
            slots += paged_attn.slot_mapping(table, pos, self.cfg.block_size)
            tables.append(table)
            seq_lens.append(start + s.num_tokens)
            qsl.append(qsl[-1] + s.num_tokens)
            # last token of each request, also of a prefill chunk that samples nothing: upstream
            # computes logits for every row (query_start_loc[1:] - 1) and drops the chunks' tokens later;
            # with drafts, the rows of the last known token and of each draft (what the model would say there)
            logits_idx += range(qsl[-1] - 1 - len(drafts.get(s.req_id, [])), qsl[-1])
        return input_ids, positions, BatchMeta(qsl, seq_lens, tables, slots), logits_idx

    def _execute(self, out: SchedulerOutput, rows: list[str], capture: tuple[str, ...]):
        """Run the batch; returns (runner record, req_id -> the tokens it sampled, captured tensors)."""
        step = self.where[0]
        by_id = {s.req_id: s for s in out.scheduled}
        batch = [by_id[rid] for rid in rows]
        drafts = out.scheduled_spec_decode_tokens
        self.where = (step, "prepare inputs")
        input_ids, positions, meta, logits_idx = self.prepare_inputs(batch, drafts)
        self.where = (step, "model forward")
        with torch.no_grad():
            hidden = self.model.forward(input_ids, positions, meta, self.caches)
            # upstream's sampler works on fp32 logits (the model's bf16 values, widened)
            logits = self.model.logits(hidden[torch.tensor(logits_idx)]).float()
        sampled: dict[str, list[int]] = {}
        row = 0  # this request's first logits row: one per request, and one more per draft
        for s in batch:
            self.where = (step, f"sample {s.req_id}")
            req = self.scheduler.requests[s.req_id]
            draft = drafts.get(s.req_id, [])
            i, row = row, row + 1 + len(draft)
            # Only a request whose whole sequence is now computed gets a token;
            # a prefill chunk that stops short of the prompt end samples nothing.
            if s.num_computed_tokens + s.num_tokens - len(draft) < req.num_tokens:
                continue
            if self.record_topk:
                self.greedy.setdefault(s.req_id, []).append(int(torch.argmax(logits[i])))
                self.topk.setdefault(s.req_id, []).append(torch.topk(logits[i], self.record_topk).indices.tolist())
            # the token the model gives after the known tokens and the first j drafts, j = 0..len(draft)
            target = [self._sample(req, logits[i + j], j) for j in range(len(draft) + 1)]
            sampled[s.req_id] = verify_greedy(draft, target) if draft else target
        self.where = (step, "capture")
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
            elif name.startswith("moe_partial.layers."):  # each expert-parallel rank's output before the all-reduce
                moe = self.model.last_moe[int(name.rsplit(".", 1)[1])]
                for rank, part in enumerate(moe.ranks):
                    if part.expert_map is not None:
                        tensors[f"{name}.rank{rank}"] = part.partial.clone()
            elif name == "logits":
                tensors[name] = logits.clone()
            elif name == "tp":  # a tensor-parallel model's collectives, per rank (reimpl/tp.py)
                tensors.update(self.model.group.recorded)
        runner = {
            "kind": "runner", "step": out.step, "proc": self.proc,
            "num_tokens": len(input_ids),
            "req_ids": rows,
            "num_scheduled_tokens": [s.num_tokens for s in batch],
            "input_ids": {"full": input_ids, "length": len(input_ids)},
            "positions": {"full": positions, "length": len(positions)},
            "query_start_loc": meta.query_start_loc,
            "seq_lens": meta.seq_lens,
            "slot_mapping": {"full": meta.slot_mapping, "length": len(meta.slot_mapping)},
            "logits_indices": logits_idx,
            "sampled_token_ids": dict(sampled),
        }
        return runner, sampled, tensors

    def _sample(self, req: Request, logits: torch.Tensor, ahead: int) -> int:
        """The token at output position num_output_tokens + ahead: upstream's where compare forces it."""
        forced = self.forced.get(req.req_id)
        if forced is not None and req.num_output_tokens + ahead < len(forced):
            return forced[req.num_output_tokens + ahead]
        return self.sampler.sample(req.req_id, logits, req.temperature, req.seed)

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

    def _spec_verify_record(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> dict:
        """schema.SpecVerifyRecord: read before update_from_output frees a finished request's blocks."""
        bs, rows = self.cfg.block_size, []
        by_id = {s.req_id: s for s in out.scheduled}
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            if not sampled.get(rid):
                continue
            before, accepted, blocks = by_id[rid].num_computed_tokens, len(sampled[rid]) - 1, self.kv.block_ids(rid)
            last = before + accepted + 1  # the model's own token: the sequence's last position now
            rows.append({"req_id": rid, "num_computed_tokens": before, "draft_token_ids": drafts,
                         "num_accepted": accepted, "sampled_token_ids": sampled[rid],
                         "rejected_slots": [blocks[p // bs] * bs + p % bs for p in range(last, before + 1 + len(drafts))],
                         "rejected_only_blocks": blocks[last // bs + 1:]})
        return {"kind": "spec_verify", "step": out.step, "proc": self.proc,
                # ngram drafts are token ids only: no KV slots reserved past the scheduled tokens
                "num_speculative_tokens": self.proposer.k, "num_lookahead_tokens": 0, "requests": rows}

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
