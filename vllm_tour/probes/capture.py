"""Optional tensor captures (`--capture attn_out,kv_blocks`), saved as safetensors.

Names are stable so comparisons can refer to them:
  attn_out.layers.<i>   attention output of decoder layer i for this step's
                        tokens, [num_tokens, num_heads * head_dim], batch order
                        as in the runner record
  kv_blocks.layers.<i>  the KV-cache blocks this step wrote (ids in the
                        CaptureRecord's block_ids, ascending), after the write;
                        CPU layout [block, kv_head, slot, K|V * head_dim]
One file per step and rank: captures/step-<NNNN>.rank<r>.safetensors.
"""

from __future__ import annotations

import re

from ..trace.schema import CaptureRecord
from ..trace.writer import RECORDER as R
from .base import Probe

PINS = ("v0.32.0",)
NAMES = ("attn_out", "kv_blocks")
_LAYER = re.compile(r"layers\.(\d+)\.")

_slots: list[int] = []


def note_slots(slots: list[int]) -> None:
    global _slots
    _slots = slots


def _forward_after(token, result, self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
    if not R.in_execute or attn_metadata is None:
        return
    step = R.worker_step
    m = _LAYER.search(getattr(layer, "layer_name", ""))
    idx = m.group(1) if m else getattr(layer, "layer_name", "?")
    n = attn_metadata.num_actual_tokens
    name = f"attn_out.layers.{idx}"
    if R.should_capture(name, step):
        R.captures[name] = output[:n].reshape(n, -1).detach().to("cpu", copy=True)
        R.capture_meta[name] = {}
    name = f"kv_blocks.layers.{idx}"
    if R.should_capture(name, step):
        block_size = kv_cache.shape[2]
        blocks = sorted({s // block_size for s in _slots if s >= 0})
        R.captures[name] = kv_cache[blocks].detach().to("cpu", copy=True)
        R.capture_meta[name] = {"block_ids": blocks, "layout": "[block, kv_head, slot, K|V * head_dim]"}


forward = Probe(
    name="capture.attention_forward",
    target="vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
    params=("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
    records="per-layer attention output and the KV blocks written this step (only with --capture)",
    pins=PINS,
    after=_forward_after,
    capture_only=True,
    role="worker",
)

PROBES = [forward]


def flush(step: int) -> None:
    """Write this step's captured tensors (if any) and their CaptureRecords."""
    if not R.captures:
        return
    from safetensors.torch import save_file

    tensors, R.captures = R.captures, {}
    meta, R.capture_meta = R.capture_meta, {}
    rel = f"captures/step-{step:04d}.rank{R.rank}.safetensors"
    path = R.run_dir / rel
    path.parent.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    for name, t in tensors.items():
        R.write(
            CaptureRecord(
                step=step,
                proc=R.proc("worker"),
                name=name,
                file=rel,
                tensor=name,
                shape=list(t.shape),
                dtype=str(t.dtype).replace("torch.", ""),
                **meta.get(name, {}),
            )
        )
