"""The mini engine's *performance path*: same decisions, GPU-shaped execution.

`reimpl/engine.py` is written to be read and diffed: every step it builds
trace records, keeps its weights on the CPU and attends request by request.
This file keeps everything that *decides* -- the same `EngineConfig` and
`RequestIn` (config.py), the same `Scheduler` (chunked_prefill.py),
`KVCacheManager` and `BlockPool` objects, so batch composition, chunking,
block ids, prefix hits and preemptions are exactly the mini engine's -- and
the same numerics (qwen3_numerics.py: where fp32 becomes bf16), so on the CPU
its greedy tokens are the mini engine's in fp32 and in bf16. It changes only
how a step is *executed*, the way a real engine's model runner does:

- weights on the GPU in bf16, with the projections that read the same input
  fused into one matmul (q|k|v, gate|up), as upstream's `QKVParallelLinear` /
  `MergedColumnParallelLinear` do;
- one persistent KV cache per layer, [num_blocks, block_size, kv_heads,
  head_dim], written through the slot mapping and read by the Triton kernel
  of `reimpl/triton_attn.py` (any `attn_fn` with the same signature works:
  the CPU tests use `reimpl/attn_reference.py`);
- the step's inputs built once per step with numpy from a persistent
  block-table array (upstream `vllm.v1.worker.block_table.BlockTable`), copied
  to the device in one go;
- the elementwise maths of a layer (residual add + RMSNorm, q/k-norm + RoPE +
  the K/V cache write, SiLU * up) in three Triton kernels, `reimpl/fused_ops.py`
  (upstream's fused_add_rms_norm / rotary_embedding / silu_and_mul custom ops):
  9 kernels per layer instead of ~61 (on the CPU the torch ops stay); in eager
  steps the host is what limits, so each Triton kernel is looked up once per
  forward, not once per layer (reimpl/triton_launch.py), and every layer
  writes into per-forward buffers (fused_ops.LayerKernels): the host's time to
  launch a decode forward went from 13.7 to 2.9 ms on the H200 machine;
- logits only for the rows that sample (upstream `logits_indices`), sampling
  batched on the device;
- async scheduling (`EngineConfig.async_scheduling`, reimpl/async_scheduler.py):
  step t+1 is scheduled and launched before step t's tokens reach the host;
  a decode whose input token is still in flight gets it from step t's sampled
  tensor on the device, and the inputs go up through pinned memory without
  blocking, so Python's scheduling overlaps the GPU's forward;
- CUDA graphs for pure-decode steps (upstream `CUDAGraphWrapper` /
  nano-vllm's `capture_cudagraph`): the forward for a padded batch size is
  captured once and replayed; padding tokens write slot 0 of the null block
  (block 0, which no request owns) and attend one key of it; their outputs
  are dropped.

Upstream counterparts (v0.21.0 / v0.32.0): `vllm.v1.worker.gpu_model_runner.
GPUModelRunner` (`_prepare_inputs`, `execute_model`, `sample_tokens`,
`capture_model`), `vllm.v1.engine.core.EngineCore.step` and, with async
scheduling, `EngineCore.step_with_batch_queue`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .async_scheduler import AsyncScheduler
from .chunked_prefill import Scheduler, SchedulerOutput
from .config import EngineConfig, RequestIn, admit_arrivals
from .kv_cache_manager import KVCacheManager
from .qwen3_numerics import add_rms_norm, apply_rope, rms_norm, rope_cos_sin, silu_and_mul

AttnFn = Callable[..., torch.Tensor]  # (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q) -> out


def default_attn_fn(device: torch.device) -> AttnFn:
    """The Triton kernel on a GPU; the fp32 torch reference elsewhere."""
    if device.type == "cuda":
        from .triton_attn import PagedAttention

        last: list = [(), None, None]  # (the tensors of the last call, its launch, its output buffer)

        def triton_fn(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q):
            # Every layer of a forward passes the same batch tensors and the same q buffer (a new one per forward,
            # fused_ops.LayerKernels): the launch is worked out on the first layer. Never reused by another
            # forward: its split buffers may belong to a captured graph.
            seen = last[0]
            if len(seen) != 4 or any(a is not b for a, b in zip(seen, (q, block_table, cu_seqlens_q, seq_lens))):
                last[:] = ((q, block_table, cu_seqlens_q, seq_lens),
                           PagedAttention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q),
                           torch.empty_like(q))  # the output, reused by every layer as the q buffer is
            return last[1](q, k_cache, v_cache, last[2])

        return triton_fn
    from .attn_reference import paged_attention_reference

    def ref_fn(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q):
        return paged_attention_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)

    return ref_fn


# --------------------------------------------------------------------------
# The model: Qwen3 (qwen3.py's numerics, from qwen3_numerics.py), fused projections, on a device
# --------------------------------------------------------------------------
class FastQwen3:
    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], device="cuda", dtype=torch.bfloat16,
                 fused: bool | None = None):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        # Triton kernels for the elementwise maths (reimpl/fused_ops.py): on a GPU by default; the CPU
        # keeps the torch ops (tests/test_fused_ops.py runs the kernels there under TRITON_INTERPRET=1).
        self.fused = (self.device.type == "cuda") if fused is None else fused
        c = cfg
        self.num_layers = c["num_hidden_layers"]
        self.num_heads = c["num_attention_heads"]
        self.num_kv_heads = c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.num_heads
        self.hidden = c["hidden_size"]
        self.eps = c["rms_norm_eps"]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        def W(name):
            return weights[name].to(self.device, dtype)

        self.embed = W("model.embed_tokens.weight")
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "ln1": W(p + "input_layernorm.weight"),
                "qkv": torch.cat([W(p + "self_attn.q_proj.weight"), W(p + "self_attn.k_proj.weight"),
                                  W(p + "self_attn.v_proj.weight")], 0).contiguous(),
                "q_norm": W(p + "self_attn.q_norm.weight"),
                "k_norm": W(p + "self_attn.k_norm.weight"),
                "o": W(p + "self_attn.o_proj.weight"),
                "ln2": W(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([W(p + "mlp.gate_proj.weight"), W(p + "mlp.up_proj.weight")], 0).contiguous(),
                "down": W(p + "mlp.down_proj.weight"),
            })  # fmt: skip
        for L in self.layers:  # x @ W.T as views, made once (the fused path's matmuls write into buffers)
            L.update({f"{name}_t": L[name].t() for name in ("qkv", "o", "gate_up", "down")})
        self.norm = W("model.norm.weight")
        self.lm_head = W("lm_head.weight") if "lm_head.weight" in weights else self.embed
        # RoPE tables [max_pos, head_dim / 2] (neox halves) in the model dtype, indexed by position.
        cos, sin = rope_cos_sin(c["max_position_embeddings"], self.head_dim, c.get("rope_theta", 10000.0), dtype)
        self.cos, self.sin = cos.to(self.device).contiguous(), sin.to(self.device).contiguous()

    @classmethod
    def from_dir(cls, model_dir: str | Path, device="cuda", dtype=torch.bfloat16, fused: bool | None = None) -> "FastQwen3":
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        return cls(cfg, load_file(str(model_dir / "model.safetensors")), device, dtype, fused)

    @classmethod
    def random(cls, cfg: dict, device="cuda", dtype=torch.bfloat16, seed: int = 0,
               fused: bool | None = None) -> "FastQwen3":
        """Random weights with the checkpoint's shapes (upstream `load_format="dummy"`)."""
        g = torch.Generator(device=device).manual_seed(seed)
        H, I = cfg["hidden_size"], cfg["intermediate_size"]
        nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or H // nh
        w: dict[str, torch.Tensor] = {}

        def rnd(*shape, std=0.02):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

        w["model.embed_tokens.weight"] = rnd(cfg["vocab_size"], H)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            w[p + "input_layernorm.weight"] = torch.ones(H, device=device, dtype=dtype)
            w[p + "post_attention_layernorm.weight"] = torch.ones(H, device=device, dtype=dtype)
            w[p + "self_attn.q_proj.weight"] = rnd(nh * hd, H)
            w[p + "self_attn.k_proj.weight"] = rnd(kvh * hd, H)
            w[p + "self_attn.v_proj.weight"] = rnd(kvh * hd, H)
            w[p + "self_attn.o_proj.weight"] = rnd(H, nh * hd)
            w[p + "self_attn.q_norm.weight"] = torch.ones(hd, device=device, dtype=dtype)
            w[p + "self_attn.k_norm.weight"] = torch.ones(hd, device=device, dtype=dtype)
            w[p + "mlp.gate_proj.weight"] = rnd(I, H)
            w[p + "mlp.up_proj.weight"] = rnd(I, H)
            w[p + "mlp.down_proj.weight"] = rnd(H, I)
        w["model.norm.weight"] = torch.ones(H, device=device, dtype=dtype)
        if not cfg.get("tie_word_embeddings", False):
            w["lm_head.weight"] = rnd(cfg["vocab_size"], H)
        return cls(cfg, w, device, dtype, fused)

    def new_kv_caches(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                 torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in range(self.num_layers)]

    def forward(self, input_ids, positions, slot_mapping, block_table, cu_seqlens_q, seq_lens, max_seqlen_q: int,
                caches, attn_fn: AttnFn) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm (all tensors on self.device)."""
        if self.fused:
            return self._forward_fused(input_ids, positions, slot_mapping, block_table, cu_seqlens_q, seq_lens,
                                       max_seqlen_q, caches, attn_fn)
        n, nh, kvh, hd, eps = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed[input_ids]  # the residual stream
        h = rms_norm(x, self.layers[0]["ln1"], eps)
        for i, (L, (kc, vc)) in enumerate(zip(self.layers, caches)):
            qkv = F.linear(h, L["qkv"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(rms_norm(q.reshape(n, nh, hd), L["q_norm"], eps), cos, sin)
            k = apply_rope(rms_norm(k.reshape(n, kvh, hd), L["k_norm"], eps), cos, sin)
            # write this step's K/V into their slots (slot = block * block_size + offset)
            kc.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
            vc.view(-1, kvh, hd).index_copy_(0, slot_mapping, v.reshape(n, kvh, hd))
            o = attn_fn(q.contiguous(), kc, vc, block_table, cu_seqlens_q, seq_lens, max_seqlen_q)
            x, h = add_rms_norm(x, F.linear(o.reshape(n, nh * hd), L["o"]), L["ln2"], eps)
            gate, up = F.linear(h, L["gate_up"]).chunk(2, dim=-1)
            # the next layer's input norm, or after the last layer the final norm
            norm = self.layers[i + 1]["ln1"] if i + 1 < self.num_layers else self.norm
            x, h = add_rms_norm(x, F.linear(silu_and_mul(gate, up), L["down"]), norm, eps)
        return h

    def _forward_fused(self, input_ids, positions, slot_mapping, block_table, cu_seqlens_q, seq_lens,
                       max_seqlen_q: int, caches, attn_fn: AttnFn) -> torch.Tensor:
        """`forward` with the elementwise maths in three Triton kernels (reimpl/fused_ops.py): per layer
        2 x add+RMSNorm, 1 x q/k-norm+RoPE+K/V write, 1 x SiLU*mul, besides the 4 matmuls and attention.
        The residual stream `x` is updated in place, as upstream's fused_add_rms_norm does."""
        from .fused_ops import LayerKernels, rms_norm

        n, nh, hd = input_ids.shape[0], self.num_heads, self.head_dim
        k = LayerKernels(n, self.hidden, self.layers[0]["down"].shape[1], nh, self.num_kv_heads, hd, self.eps,
                         self.device, self.dtype)
        x = self.embed[input_ids]  # the residual stream
        delta = None  # what the previous layer adds to it
        for L, (kc, vc) in zip(self.layers, caches):
            if delta is None:
                h = rms_norm(x, L["ln1"], self.eps)
            else:
                h, x = k.add_rms_norm(delta, x, L["ln1"])
            qkv = k.linear(h, L["qkv_t"], k.qkv)
            q = k.qk_norm_rope_kv_write(qkv, L["q_norm"], L["k_norm"], self.cos, self.sin, positions, slot_mapping,
                                        kc, vc)
            o = attn_fn(q, kc, vc, block_table, cu_seqlens_q, seq_lens, max_seqlen_q)
            h, x = k.add_rms_norm(k.linear(o.view(n, nh * hd), L["o_t"], k.o), x, L["ln2"])
            delta = k.linear(k.silu_and_mul(k.linear(h, L["gate_up_t"], k.gate_up)), L["down_t"], k.down)
        if delta is None:
            return rms_norm(x, self.norm, self.eps)
        return k.add_rms_norm(delta, x, self.norm)[0]

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        out = F.linear(hidden, self.lm_head)
        return out.float() if upcast else out


# --------------------------------------------------------------------------
# The engine loop: reimpl's scheduler, a GPU-shaped model runner
# --------------------------------------------------------------------------
@dataclass
class StepInputs:
    """One step's model inputs on the host (upstream: the persistent input batch's numpy views)."""

    ids: np.ndarray  # [num_tokens] token ids (0 where the id comes from the step in flight)
    positions: np.ndarray  # [num_tokens]
    slots: np.ndarray  # [num_tokens] block * block_size + offset
    rows: np.ndarray  # [num_seqs] block-table row of each scheduled request
    cu: np.ndarray  # [num_seqs + 1] query start offsets
    seq_lens: np.ndarray  # [num_seqs] tokens in the cache after this step
    max_q: int
    sample_idx: list[int]  # token index of each sampling row
    sample_rids: list[str]
    prev_dst: np.ndarray  # async: ids[prev_dst] = previous step's sampled[prev_src]
    prev_src: np.ndarray


@dataclass
class InFlight:
    """A launched step: its tokens are (or will be) in `tokens`, ready when `done` has fired."""

    out: SchedulerOutput
    sample_rids: list[str]
    tokens: torch.Tensor | None
    top: torch.Tensor | None
    done: "torch.cuda.Event | None"
    index: dict[str, int] = field(default_factory=dict)  # request -> its row in `tokens`


@dataclass
class RunStats:
    steps: int = 0
    decode_steps: int = 0
    graph_steps: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    graph_capture_s: float = 0.0
    host_s: float = 0.0  # scheduler + input building on the CPU
    extra: dict = field(default_factory=dict)


class FastEngine:
    def __init__(self, model: FastQwen3, cfg: EngineConfig, attn_fn: AttnFn | None = None):
        self.model, self.cfg = model, cfg
        self.device = model.device
        self.attn_fn = attn_fn or default_attn_fn(self.device)
        # the teaching engine's KV manager and scheduler, built from the same config fields (pin policies included)
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.max_model_len,
                                 cfg.free_policy)
        scheduler_cls = AsyncScheduler if cfg.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(self.kv, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                                       cfg.enable_chunked_prefill, cfg.reserve_full_sequence,
                                       cfg.long_prefill_token_threshold, cfg.long_prefill_token_threshold_adaptive)
        self.caches = model.new_kv_caches(cfg.num_blocks, cfg.block_size)
        # Persistent block table: one row per running request (upstream BlockTable).
        self.max_blocks = math.ceil(cfg.max_model_len / cfg.block_size)
        self.bt = np.zeros((cfg.max_num_seqs, self.max_blocks), dtype=np.int32)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.sample_calls = 0  # keys the fused sampler's noise
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stats = RunStats()
        # top-k token ids per sampled position, per request (for vLLM's logprob rule); 0 = off
        self.record_topk = 0
        self.topk: dict[str, list[list[int]]] = {}
        # the last launched step's sampled tokens (on the device) and each request's row in them
        self.prev_tokens: torch.Tensor | None = None
        self.prev_index: dict[str, int] = {}

    # --- block-table rows ------------------------------------------------------------
    def _row(self, rid: str) -> int:
        r = self.row_of.get(rid)
        if r is None:
            r = self.row_of[rid] = self.free_rows.pop()
        return r

    def _release(self, rid: str) -> None:
        r = self.row_of.pop(rid, None)
        if r is not None:
            self.free_rows.append(r)

    # --- inputs -----------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """numpy arrays for the step (upstream _prepare_inputs), plus which rows sample."""
        reqs = self.scheduler.requests
        n_sched = len(out.scheduled)
        ids, rows, starts, lens = [], np.empty(n_sched, np.int64), np.empty(n_sched, np.int64), np.empty(n_sched, np.int64)
        sample_idx, sample_rids, prev_dst, prev_src = [], [], [], []
        total = 0
        # Longest sequence first: the attention kernel's programs start in row order, so the long ones start
        # first and the short ones fill the end (longest-processing-time-first; in the race's decode steps,
        # contexts of ~100 to ~2000 tokens side by side, the longest started last would run alone at the
        # end). Only the rows' order changes: each row samples for its own request.
        order = sorted(out.scheduled, key=lambda s: -(s.num_computed_tokens + s.num_tokens))
        for i, s in enumerate(order):
            req = reqs[s.req_id]
            start, n = s.num_computed_tokens, s.num_tokens
            r = self._row(s.req_id)
            if s.kind != "running" or out.new_block_ids.get(s.req_id):
                blocks = self.kv.block_ids(s.req_id)  # new, resumed (hits included) or grown
                self.bt[r, : len(blocks)] = blocks
            known = req.num_tokens
            if n == 1 and start == known - 1:  # a decode: the last token
                ids.append(req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
            elif start + n <= req.num_prompt_tokens:
                ids.extend(req.prompt_token_ids[start : start + n])
            else:
                ids.extend(req.all_token_ids[start : min(start + n, known)])
                if start + n > known:  # async: the last input was sampled by the step still in flight
                    assert start + n == known + 1, (s.req_id, start, n, known)
                    prev_dst.append(total + n - 1)
                    prev_src.append(self.prev_index[s.req_id])
                    ids.append(0)  # overwritten on the GPU
            rows[i], starts[i], lens[i] = r, start, n
            total += n
            in_flight = 1 if s.req_id in self.prev_index else 0  # async: a token still on its way back
            if start + n >= known + in_flight:  # reaches the end of the sequence: samples
                sample_idx.append(total - 1)
                sample_rids.append(s.req_id)
        cu = np.zeros(n_sched + 1, np.int32)
        np.cumsum(lens, out=cu[1:])
        seq_lens = (starts + lens).astype(np.int32)
        tok_row = np.repeat(rows, lens)
        positions = np.repeat(starts - cu[:-1], lens) + np.arange(total)
        bs = self.cfg.block_size
        slots = self.bt[tok_row, positions // bs].astype(np.int64) * bs + positions % bs
        return StepInputs(np.asarray(ids, np.int64), positions.astype(np.int64), slots, rows, cu, seq_lens,
                          int(lens.max()) if n_sched else 0, sample_idx, sample_rids,
                          np.asarray(prev_dst, np.int64), np.asarray(prev_src, np.int64))

    # --- one step ---------------------------------------------------------------------
    def _upload(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        """The step's host arrays on the device, one copy per dtype. On a GPU the copy goes through
        pinned memory without blocking: a plain .to() from pageable memory would wait for the GPU to
        finish the previous step, which is what async scheduling must avoid."""
        groups: dict[np.dtype, list[str]] = {}
        for k, a in arrays.items():
            groups.setdefault(a.dtype, []).append(k)
        res = {}
        for dtype, names in groups.items():
            # Every part starts on a 16-byte boundary. Triton compiles a kernel variant per pointer
            # alignment (16 bytes or not): packed end to end, a part's alignment would follow the sizes of
            # the parts before it, and steps of new sizes would stop to compile mid-run.
            per = 16 // dtype.itemsize
            sizes = [arrays[k].size for k in names]
            starts = np.cumsum([0] + [-(-n // per) * per for n in sizes]).tolist()
            flat = np.zeros(starts[-1], dtype)
            for k, s, n in zip(names, starts, sizes):
                flat[s : s + n] = arrays[k].ravel()
            dev = torch.from_numpy(flat)
            if self.device.type == "cuda":
                dev = dev.pin_memory().to(self.device, non_blocking=True)
            res.update({k: dev[s : s + n].view(arrays[k].shape) for k, s, n in zip(names, starts, sizes)})
        return res

    def launch(self, out: SchedulerOutput) -> InFlight:
        """Queue the step's forward and sampling on the device; the tokens come back in `collect`."""
        x = self.prepare(out)
        n_seqs = len(out.scheduled)
        width = int(np.max((x.seq_lens + self.cfg.block_size - 1) // self.cfg.block_size)) if n_seqs else 1
        temps = np.array([self.scheduler.requests[r].temperature for r in x.sample_rids], np.float32)
        d = self._upload(ids=x.ids, pos=x.positions, slots=x.slots, cu=x.cu, seq_lens=x.seq_lens,
                         bt=np.ascontiguousarray(self.bt[x.rows, :width]), sample_idx=np.asarray(x.sample_idx, np.int64),
                         prev_dst=x.prev_dst, prev_src=x.prev_src, temps=temps)
        if x.prev_dst.size:
            d["ids"].index_copy_(0, d["prev_dst"], self.prev_tokens[d["prev_src"]])
        g = self._graph_size(n_seqs) if (x.max_q == 1 and self.graphs) else None
        if g is not None:
            hidden = self._replay(g, d, n_seqs, width)
            self.stats.graph_steps += 1
        else:
            hidden = self.model.forward(d["ids"], d["pos"], d["slots"], d["bt"], d["cu"], d["seq_lens"], x.max_q,
                                        self.caches, self.attn_fn)
        if x.max_q == 1:
            self.stats.decode_steps += 1
        if not x.sample_rids:
            self.prev_index = {}
            return InFlight(out, [], None, None, None)
        # the fused sampler reads the model dtype; the torch sampler and the top-k record want fp32
        logits = self.model.logits(hidden[d["sample_idx"]], upcast=not self.model.fused or self.record_topk > 0)
        tokens = self.sample(logits, d["temps"], bool((temps <= 0).all()))
        self.prev_tokens, self.prev_index = tokens, {rid: i for i, rid in enumerate(x.sample_rids)}
        top = logits.topk(self.record_topk, dim=-1).indices if self.record_topk else None
        if self.device.type != "cuda":
            return InFlight(out, x.sample_rids, tokens, top, None, self.prev_index)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return InFlight(out, x.sample_rids, host, top, done, self.prev_index)

    def collect(self, f: InFlight) -> dict[str, int]:
        """Wait for a launched step's tokens (the only point where the host waits for the device)."""
        if not f.sample_rids:
            return {}
        if f.index is self.prev_index:
            self.prev_index = {}  # the latest launch is back: none of its tokens is in flight any more
        if f.done is not None:
            f.done.synchronize()
        if f.top is not None:
            for rid, top in zip(f.sample_rids, f.top.tolist()):
                self.topk.setdefault(rid, []).append(top)
        return dict(zip(f.sample_rids, f.tokens.tolist()))

    def sample(self, logits: torch.Tensor, temps: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """temps: [rows] float32 on the device; <= 0 means greedy. On a GPU (with the fused kernels) one
        Triton pass over the logits (fused_ops.sample: Gumbel-max without the softmax), noise keyed by the
        engine's seed and the step; elsewhere the same draw in torch ops with the engine's generator."""
        if self.model.fused:
            from .fused_ops import sample

            self.sample_calls += 1
            return sample(logits, temps, self.cfg.seed * 1_000_003 + self.sample_calls)
        greedy = logits.argmax(-1)
        if all_greedy:
            return greedy
        t = torch.where(temps > 0, temps, torch.ones_like(temps)).unsqueeze(1)
        probs = torch.softmax(logits / t, dim=-1)
        # argmax(p / E), E ~ Exp(1), draws from p (Gumbel-max; see sampler.py)
        noise = torch.empty_like(probs).exponential_(generator=self.gen)
        rand = (probs / noise).argmax(-1)
        return torch.where(temps > 0, rand, greedy)

    # --- CUDA graphs for decode ------------------------------------------------------------
    def _graph_size(self, n: int) -> int | None:
        for g in sorted(self.graphs):
            if g >= n:
                return g
        return None

    def capture_graphs(self) -> None:
        """Capture the decode forward for each padded batch size, largest first (shared pool)."""
        if self.device.type != "cuda" or not self.cfg.cuda_graphs:
            return
        t0 = time.perf_counter()
        sizes = sorted((b for b in self.cfg.graph_batch_sizes if b <= self.cfg.max_num_seqs), reverse=True)
        G = sizes[0]
        dev = self.device
        self.g_in = {
            "ids": torch.zeros(G, dtype=torch.int64, device=dev),
            "pos": torch.zeros(G, dtype=torch.int64, device=dev),
            "slots": torch.zeros(G, dtype=torch.int64, device=dev),  # 0: slot 0 of the null block
            "bt": torch.zeros(G, self.max_blocks, dtype=torch.int32, device=dev),
            "cu": torch.arange(G + 1, dtype=torch.int32, device=dev),
            "seq_lens": torch.ones(G, dtype=torch.int32, device=dev),
        }
        self.g_out: dict[int, torch.Tensor] = {}
        pool = None
        stream = torch.cuda.Stream()
        for b in sizes:
            i = self.g_in
            args = (i["ids"][:b], i["pos"][:b], i["slots"][:b], i["bt"][:b], i["cu"][: b + 1], i["seq_lens"][:b], 1,
                    self.caches, self.attn_fn)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the graph
                self.model.forward(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.g_out[b] = self.model.forward(*args)
            if pool is None:
                pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        self.stats.graph_capture_s = time.perf_counter() - t0

    def _replay(self, g: int, d: dict[str, torch.Tensor], n: int, width: int) -> torch.Tensor:
        i = self.g_in
        for k in ("ids", "pos", "slots", "seq_lens"):
            i[k][:n].copy_(d[k])
        i["bt"][:n, :width].copy_(d["bt"])
        if n < g:  # padding rows: one key of the null block, written to its slot 0
            i["slots"][n:g].zero_()
            i["seq_lens"][n:g].fill_(1)
            i["bt"][n:g, 0].zero_()
        self.graphs[g].replay()
        return self.g_out[g][:n]

    # --- the loop -----------------------------------------------------------------------
    def generate(self, requests: list[RequestIn], max_steps: int = 1_000_000, on_step=None) -> dict[str, list[int]]:
        """Run every request to completion; returns output token ids per request.

        Arrivals as in `engine.Engine.run`; `on_step(out, sampled)` sees each
        step's SchedulerOutput and sampled tokens (tests diff decisions with it).
        """
        t0 = time.perf_counter()
        pending = sorted(requests, key=lambda r: r.arrival_step)
        sched = self.scheduler
        step, in_flight = 0, None
        while (pending or sched.has_unfinished()) and step < max_steps:
            h0 = time.perf_counter()
            admit_arrivals(pending, sched, step)
            out = sched.schedule()
            step += 1
            self.stats.steps += bool(out.scheduled)
            self.stats.preemptions += len(out.preempted)
            for p in out.preempted:
                self._release(p.req_id)  # its blocks are gone; a fresh row on resume
            self.stats.host_s += time.perf_counter() - h0
            launched = self.launch(out) if out.scheduled else InFlight(out, [], None, None, None)
            if in_flight is not None:  # async: step t-1 finishes while step t runs
                self._finish(in_flight, on_step)
            in_flight = launched
            if not self.cfg.async_scheduling:
                self._finish(in_flight, on_step)
                in_flight = None
        if in_flight is not None:
            self._finish(in_flight, on_step)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.seconds += time.perf_counter() - t0
        outs = {r.req_id: list(sched.requests[r.req_id].output_token_ids) for r in requests}
        self.stats.output_tokens += sum(len(v) for v in outs.values())
        return outs

    def _finish(self, f: InFlight, on_step) -> None:
        sampled = self.collect(f)
        h0 = time.perf_counter()
        for s in f.out.scheduled:
            if s.num_tokens > 1 or s.kind != "running":
                self.stats.prefill_tokens += s.num_tokens
        for r in self.scheduler.update_from_output(f.out, sampled):
            self._release(r.req_id)
        self.stats.host_s += time.perf_counter() - h0
        if on_step:
            on_step(f.out, sampled)
