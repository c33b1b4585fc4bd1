"""Tensor parallelism: Qwen3 split across `world_size` ranks, each holding a shard of every weight.

Upstream counterparts (v0.32.0):
- `vllm.model_executor.layers.linear.ColumnParallelLinear`: cuts the output dim; rank r holds rows
  [r*out/tp, (r+1)*out/tp) (`weight_loader`); no communication, the output stays sharded (`forward`,
  gather_output=False).
- `vllm.model_executor.layers.linear.MergedColumnParallelLinear`: gate and up each cut like a column
  layer, then stacked: rank r holds [gate_r; up_r], not a contiguous slice of the fused [gate; up].
- `vllm.model_executor.layers.linear.QKVParallelLinear`: rank r holds [q_r; k_r'; v_r']; with more
  ranks than KV heads (tp > num_kv_heads) each KV head is *replicated* on tp/num_kv_heads ranks.
- `vllm.model_executor.layers.linear.RowParallelLinear`: cuts the input dim; each rank's product is a
  partial sum; the bias is added on rank 0 only, then `tensor_model_parallel_all_reduce`.
- `vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding` and `ParallelLMHead`:
  the vocab padded to a multiple of 64 (`pad_vocab_size`), cut in equal shards; a rank looks up the
  ids in its shard, zeroes the others' rows, then all-reduce. The LM head's logits shards are gathered
  (`vllm.model_executor.layers.logits_processor.LogitsProcessor._gather_logits`) and cut to the vocab.
- `vllm.distributed.parallel_state.GroupCoordinator.all_reduce` / `all_gather`, on CPU through
  `vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator` (an in-place SHM all-reduce).

The rank code is written once, SPMD style: every per-rank value is a list over `group.ranks`, the ranks
this process runs. `SimulatedGroup` runs every rank in one process (all-reduce = a sum in rank order:
deterministic; compare and the tests use it); `DistributedGroup` runs one rank per process over
torch.distributed (gloo on CPU, NCCL on GPUs) and computes the same values.

Per decoder layer two all-reduces (o_proj, down_proj), plus the embedding's, plus the logits gather. The MLP
(`mlp`, its shards `_shard_mlp`) is the one part tp_moe.py replaces: a Qwen3-MoE block with every expert sharded.
Each rank keeps its own residual stream and final hidden states, and computes its logits shard from them
(`vllm.model_executor.layers.logits_processor.LogitsProcessor._get_logits` runs on every rank).
The maths between the collectives is qwen3.py's (qwen3_numerics.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .paged_attn import BatchMeta, PagedKVCache, paged_attention
from .qwen3_numerics import DTYPES, add_rms_norm, apply_rope, rms_norm, rope_cos_sin, silu_and_mul

VOCAB_PADDING = 64  # vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


# --- the process group: what crosses between ranks ---------------------------------------------------


class SimulatedGroup:
    """Every rank in this process. `recorded` keeps each collective's input and output per rank
    (tp.<op>_in.<layer> / tp.<op>_out.<layer>, keyed "rank<r>/..."), and each column-parallel layer's output
    shard (tp.column_out.<layer>), as the upstream probes capture them."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.ranks = list(range(world_size))
        self.recorded: dict[str, torch.Tensor] = {}

    def all_reduce(self, parts: list[torch.Tensor], layer: str) -> list[torch.Tensor]:
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return self._record("all_reduce", layer, parts, [total.clone() for _ in parts])

    def all_gather(self, parts: list[torch.Tensor], layer: str) -> list[torch.Tensor]:
        whole = torch.cat(parts, dim=-1)
        return self._record("all_gather", layer, parts, [whole.clone() for _ in parts])

    def keep(self, rank: int, name: str, t: torch.Tensor) -> None:
        """Record `rank`'s tensor under upstream's capture name (tp.<name>)."""
        self.recorded[f"rank{rank}/tp.{name}"] = t.clone()

    def _record(self, op, layer, ins, outs):
        for r, x_in, x_out in zip(self.ranks, ins, outs):
            self.keep(r, f"{op}_in.{layer}", x_in)
            self.keep(r, f"{op}_out.{layer}", x_out)
        return outs


class DistributedGroup(SimulatedGroup):
    """This process is one rank of a torch.distributed group: gloo on CPU, or NCCL, whose collectives run on
    this rank's GPU (the model's tensors go there and back for each one)."""

    def __init__(self, rank: int, world_size: int, backend: str = "gloo", init_method: str = "env://"):
        import torch.distributed as dist

        self.dist = dist
        self.device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        self.world_size = world_size
        self.ranks = [rank]
        self.recorded = {}

    def all_reduce(self, parts, layer):
        total = parts[0].to(self.device, copy=True)
        self.dist.all_reduce(total)
        return self._record("all_reduce", layer, parts, [total.to(parts[0].device)])

    def all_gather(self, parts, layer):
        mine = parts[0].to(self.device).contiguous()
        pieces = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.dist.all_gather(pieces, mine)
        return self._record("all_gather", layer, parts, [torch.cat(pieces, dim=-1).to(parts[0].device)])

    def close(self) -> None:
        self.dist.destroy_process_group()


# --- the sharding rules: which rows or columns of a checkpoint tensor rank r holds -----------------------


def column_shard(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """ColumnParallelLinear: output rows [rank*n, (rank+1)*n)."""
    n = w.shape[0] // world
    return w[rank * n:(rank + 1) * n]


def merged_column_shard(ws: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """MergedColumnParallelLinear: each logical matrix cut on its own, then stacked: [gate_r; up_r]."""
    return torch.cat([column_shard(w, rank, world) for w in ws])


def kv_head_range(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """QKVParallelLinear's KV heads for `rank`: a slice when tp <= num_kv_heads, else one replicated head."""
    if world <= num_kv_heads:
        per = num_kv_heads // world
        return rank * per, (rank + 1) * per
    head = rank // (world // num_kv_heads)  # tp/num_kv_heads consecutive ranks share one head
    return head, head + 1


def qkv_shard(q, k, v, num_kv_heads: int, head_dim: int, rank: int, world: int) -> torch.Tensor:
    """QKVParallelLinear: [q_r; k_r'; v_r']."""
    lo, hi = kv_head_range(num_kv_heads, rank, world)
    return torch.cat([column_shard(q, rank, world), k[lo * head_dim:hi * head_dim], v[lo * head_dim:hi * head_dim]])


def column_parallel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One rank's column-parallel output: its slice of the output features, laid out as its weight shard
    ([q_r; k_r'; v_r'], [gate_r; up_r]). Nothing is gathered: the next op works on the slice (its heads,
    its intermediate channels) until a row-parallel layer sums the ranks' contributions."""
    return x @ w.T


def row_shard(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """RowParallelLinear: input columns [rank*n, (rank+1)*n)."""
    n = w.shape[1] // world
    return w[:, rank * n:(rank + 1) * n]


def row_parallel(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, rank: int) -> torch.Tensor:
    """One rank's partial sum; the bias only on rank 0, or the all-reduce would add it tp times."""
    y = x @ w.T
    return y + bias if bias is not None and rank == 0 else y


def pad_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int, int]:
    """(first id, end of real ids, rows per shard) of rank's shard of the padded vocab."""
    per = pad_vocab(vocab_size) // world
    start = rank * per
    return start, min(start + per, vocab_size), per


def vocab_shard(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """VocabParallelEmbedding / ParallelLMHead: the shard's rows, padding rows zero."""
    start, end, per = vocab_range(w.shape[0], rank, world)
    shard = torch.zeros(per, w.shape[1], dtype=w.dtype)
    shard[:end - start] = w[start:end]
    return shard


def vocab_parallel_embedding(ids: torch.Tensor, shard: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Look up the ids this shard holds; the others' rows are zero (the all-reduce fills them in)."""
    mine = (ids >= start) & (ids < end)
    out = shard[torch.where(mine, ids - start, 0)]
    return out.masked_fill(~mine.unsqueeze(-1), 0)


# --- the model ------------------------------------------------------------------------------------------


class TPQwen3:
    """qwen3.Qwen3 across the ranks of `group` (the same checkpoint, forward and logits interface)."""

    def __init__(self, model_dir: str | Path, group: SimulatedGroup, attention=paged_attention,
                 dtype: str | torch.dtype = torch.float32):
        model_dir = Path(model_dir)
        self.group, self.attention = group, attention
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        c = self.cfg = json.loads((model_dir / "config.json").read_text())
        self.num_layers = c["num_hidden_layers"]
        self.num_heads = c["num_attention_heads"]
        self.num_kv_heads = c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.num_heads
        self.vocab_size = c["vocab_size"]
        self.eps = c["rms_norm_eps"]
        self.cos, self.sin = rope_cos_sin(c["max_position_embeddings"], self.head_dim, c.get("rope_theta", 10000.0),
                                          self.dtype)
        w = {k: v.to(self.dtype) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        world = group.world_size
        self.heads_per_rank = self.num_heads // world
        lo, hi = kv_head_range(self.num_kv_heads, 0, world)
        self.kv_heads_per_rank = hi - lo
        # rank -> {upstream parameter name: the shard that rank holds}
        self.shards = {r: self._shard(w, r, world) for r in group.ranks}
        self.last_attn_out: dict[int, torch.Tensor] = {}  # rank 0's, when this process runs it

    def _shard(self, w: dict, r: int, world: int) -> dict[str, torch.Tensor]:
        lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        s = {"model.embed_tokens.weight": vocab_shard(w["model.embed_tokens.weight"], r, world)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            s[a + "qkv_proj.weight"] = qkv_shard(w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"],
                                                 self.num_kv_heads, self.head_dim, r, world)
            s[a + "o_proj.weight"] = row_shard(w[a + "o_proj.weight"], r, world)
            s[a + "q_norm.weight"], s[a + "k_norm.weight"] = w[a + "q_norm.weight"], w[a + "k_norm.weight"]
            s.update(self._shard_mlp(w, p + "mlp.", r, world))
            for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                s[p + norm] = w[p + norm]
        s["model.norm.weight"] = w["model.norm.weight"]
        s["lm_head.weight"] = vocab_shard(lm_head, r, world)
        return {k: v.contiguous() for k, v in s.items()}

    def _shard_mlp(self, w: dict, m: str, r: int, world: int) -> dict[str, torch.Tensor]:
        """Rank r's shards of one decoder layer's MLP (m: "model.layers.<i>.mlp.")."""
        return {m + "gate_up_proj.weight": merged_column_shard([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]], r, world),
                m + "down_proj.weight": row_shard(w[m + "down_proj.weight"], r, world)}

    def new_kv_caches(self, num_blocks: int, block_size: int) -> list[list[PagedKVCache]]:
        """Per layer, per rank of this process: each rank caches only its own KV heads."""
        return [[PagedKVCache(num_blocks, block_size, self.kv_heads_per_rank, self.head_dim, self.dtype)
                 for _ in self.group.ranks] for _ in range(self.num_layers)]

    def forward(self, input_ids: list[int], positions: list[int], meta: BatchMeta,
                caches: list[list[PagedKVCache]]) -> torch.Tensor:
        """Hidden states after the final norm, per rank of this process: [num_tokens, ranks, hidden]."""
        g, ranks, n, hd = self.group, self.group.ranks, len(input_ids), self.head_dim
        g.recorded = {}
        S = [self.shards[r] for r in ranks]
        pos = torch.tensor(positions, dtype=torch.long)
        cos, sin = self.cos[pos], self.sin[pos]
        ids = torch.tensor(input_ids, dtype=torch.long)
        parts = []
        for r, s in zip(ranks, S):
            start, end, _ = vocab_range(self.vocab_size, r, g.world_size)
            parts.append(vocab_parallel_embedding(ids, s["model.embed_tokens.weight"], start, end))
        xs = g.all_reduce(parts, "model.embed_tokens")  # the residual stream, one copy per rank
        hs = [rms_norm(x, s["model.layers.0.input_layernorm.weight"], self.eps) for x, s in zip(xs, S)]
        nq, nkv = self.heads_per_rank * hd, self.kv_heads_per_rank * hd
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            partials = []
            for j, (r, s, h) in enumerate(zip(ranks, S, hs)):
                qkv = column_parallel(h, s[p + "self_attn.qkv_proj.weight"])
                g.keep(r, f"column_out.{p}self_attn.qkv_proj", qkv)
                q = qkv[:, :nq].reshape(n, self.heads_per_rank, hd)
                k = qkv[:, nq:nq + nkv].reshape(n, self.kv_heads_per_rank, hd)
                v = qkv[:, nq + nkv:].reshape(n, self.kv_heads_per_rank, hd)
                q = apply_rope(rms_norm(q, s[p + "self_attn.q_norm.weight"], self.eps), cos, sin)
                k = apply_rope(rms_norm(k, s[p + "self_attn.k_norm.weight"], self.eps), cos, sin)
                attn = self.attention(q, k, v, caches[i][j], meta)
                if r == 0:
                    self.last_attn_out[i] = attn
                partials.append(row_parallel(attn, s[p + "self_attn.o_proj.weight"], None, r))
            reduced = g.all_reduce(partials, p + "self_attn.o_proj")
            xs, hs = zip(*(add_rms_norm(x, y, s[p + "post_attention_layernorm.weight"], self.eps)
                           for x, y, s in zip(xs, reduced, S)))
            reduced = self.mlp(i, hs)
            norm = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < self.num_layers else "model.norm.weight"
            xs, hs = zip(*(add_rms_norm(x, y, s[norm], self.eps) for x, y, s in zip(xs, reduced, S)))
        for r, h in zip(ranks, hs):  # no collective: compare checks the ranks agree (tp_diff.final_hidden_disagreements)
            g.recorded[f"rank{r}/final_hidden"] = h.clone()
        return torch.stack(hs, dim=1)

    def mlp(self, i: int, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Layer i's MLP on each rank's input, all-reduced: gate_up column-parallel, down_proj row-parallel."""
        g, m = self.group, f"model.layers.{i}.mlp."
        partials = []
        for r, h in zip(g.ranks, hs):
            s = self.shards[r]
            gate_up = column_parallel(h, s[m + "gate_up_proj.weight"])
            g.keep(r, f"column_out.{m}gate_up_proj", gate_up)
            gate, up = gate_up.chunk(2, dim=-1)  # [gate_r | up_r]
            partials.append(row_parallel(silu_and_mul(gate, up), s[m + "down_proj.weight"], None, r))
        return g.all_reduce(partials, m + "down_proj")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each rank's logits over its vocab shard, from that rank's own hidden states, gathered and cut to
        the real vocab; the first rank's copy is returned (upstream samples on rank 0).

        hidden: [tokens, ranks of this process, hidden size] (forward's output, rows picked). After the last
        all-reduce every rank should hold the same hidden states, but each computes its shard from its own,
        as upstream's ParallelLMHead does: one copy for all would hide a rank whose last layer went wrong."""
        for j, r in enumerate(self.group.ranks):
            self.group.keep(r, "final_hidden.model.norm", hidden[:, j])  # the LM head's input, as upstream captures it
        shards = [hidden[:, j] @ self.shards[r]["lm_head.weight"].T for j, r in enumerate(self.group.ranks)]
        return self.group.all_gather(shards, "logits")[0][:, :self.vocab_size]


def simulated(model_dir: str | Path, world_size: int, dtype: str = "float32", attention=paged_attention) -> TPQwen3:
    """Every rank in this process: the model compare runs (modules.py names it)."""
    return TPQwen3(model_dir, SimulatedGroup(world_size), attention, dtype)
