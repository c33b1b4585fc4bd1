"""Optional tensor captures (`--capture attn_out,kv_blocks`), saved as safetensors.

Names are stable so comparisons can refer to them:
  attn_out.layers.<i>   attention output of decoder layer i for this step's
                        tokens, [num_tokens, num_heads * head_dim], batch order
                        as in the runner record
  kv_blocks.layers.<i>  the KV-cache blocks this step wrote (ids in the
                        CaptureRecord's block_ids, ascending), after the write,
                        always in the canonical [block, K|V, kv_head, slot, head_dim]:
                        each backend's (and each CPU ISA's) layout is decoded here
                        (kv_layout.py); the record names the ISA that wrote it
One file per step and rank: captures/step-<NNNN>.rank<r>.safetensors.
"""

from __future__ import annotations

import re

from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.probes.kv_layout import CANONICAL_LAYOUT, cpu_canonical
from vllm_tour.trace.schema import CaptureRecord
from vllm_tour.trace.writer import RECORDER as R

PINS = CPU_PINS
CUDA_PINS = ("v0.21.0",)
NAMES = ("attn_out", "kv_blocks")
_LAYER = re.compile(r"layers\.(\d+)\.")

_slots: list[int] = []


def note_slots(slots: list[int]) -> None:
    global _slots
    _slots = slots


# Per backend: the written blocks in the canonical layout, and what to record about how they
# were stored (block_size is shape[2] in all three).
def _cpu_blocks(kv_cache, blocks, layer):
    isa = layer.isa  # set on every attention layer by CPUAttentionMetadataBuilder (its _get_attn_isa pick)
    return cpu_canonical(kv_cache[blocks], isa), {"isa": isa}


def _triton_blocks(kv_cache, blocks, layer):  # [blocks, 2, block_size, kv_heads, head]
    return kv_cache[blocks].permute(0, 1, 3, 2, 4), {}


def _flash_blocks(kv_cache, blocks, layer):  # [2, blocks, block_size, kv_heads, head]
    return kv_cache[:, blocks].permute(1, 0, 3, 2, 4), {}


def _forward_after(token, result, self, layer, query, key, value, kv_cache, attn_metadata, output, *a, select=_cpu_blocks, **kw):
    if not R.in_execute or attn_metadata is None:
        return
    step = R.worker_step
    m = _LAYER.search(getattr(layer, "layer_name", ""))
    idx = m.group(1) if m else getattr(layer, "layer_name", "?")
    n = attn_metadata.num_actual_tokens
    R.keep_capture(f"attn_out.layers.{idx}", output[:n].reshape(n, -1), step)
    name = f"kv_blocks.layers.{idx}"
    if R.should_capture(name, step):  # decoding the blocks costs: only when asked
        block_size = kv_cache.shape[2]
        blocks = sorted({s // block_size for s in _slots if s >= 0})
        t, written_by = select(kv_cache, blocks, layer)
        R.keep_capture(name, t, step, block_ids=blocks, layout=CANONICAL_LAYOUT, **written_by)


forward = Probe(
    name="capture.attention_forward",
    target="vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
    params=("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
    records="per-layer attention output and the KV blocks written this step (only with --capture)",
    pins=PINS,
    after=_forward_after,
    capture_only=True,
    role="worker",
    backend="CPU_ATTN",
)


def forward_probe(backend: str, target: str, select, pins: tuple[str, ...] = CUDA_PINS,
                  platform: str | None = None) -> Probe:
    """v0.21.0's CUDA impls (and MACA's): forward(..., output, output_scale=None, output_block_scale=None)."""

    def after(token, result, self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
        _forward_after(token, result, self, layer, query, key, value, kv_cache, attn_metadata, output, select=select)

    return Probe(
        name="capture.attention_forward",
        target=target,
        params=(*forward.params, "output_scale"),
        records=forward.records,
        pins=pins,
        after=after,
        capture_only=True,
        role="worker",
        backend=backend,
        platform=platform,
    )


BLOCK_SELECT = {"TRITON_ATTN": _triton_blocks, "FLASH_ATTN": _flash_blocks}  # by the KV layout each backend writes

PROBES = [
    forward,
    forward_probe("TRITON_ATTN", "vllm.v1.attention.backends.triton_attn.TritonAttentionImpl.forward", _triton_blocks),
    forward_probe("FLASH_ATTN", "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward", _flash_blocks),
]


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
