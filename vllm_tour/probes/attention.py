"""Probes on the CPU attention backend (worker processes).

The metadata builder's output is exactly what the attention kernel receives:
sequence lengths, query offsets, block-table rows and the slot mapping.
"""

from __future__ import annotations

from ..trace.schema import AttentionLayer, AttentionRecord
from ..trace.writer import RECORDER as R
from . import capture
from .base import Probe
from .runner import int_list

PINS = ("v0.32.0",)
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"


def _trim(row: list[int]) -> list[int]:
    # Rows are padded with 0, upstream's null block, which no request owns.
    end = len(row)
    while end and row[end - 1] == 0:
        end -= 1
    return row[:end]


def _layers(builder) -> list[AttentionLayer]:
    if R.layers_info is None:
        ctx = builder.vllm_config.compilation_config.static_forward_context
        layers, first = [], None
        for name in builder.layer_names:
            kv = getattr(ctx.get(name), "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0] if kv else None
            if kv is None or not hasattr(kv, "shape"):
                continue
            info = AttentionLayer(layer=name, kv_cache_shape=list(kv.shape), kv_cache_dtype=str(kv.dtype).replace("torch.", ""))
            key = (tuple(info.kv_cache_shape), info.kv_cache_dtype)
            if first is None or key != first:  # list only layers that differ from the first
                layers.append(info)
                first = first or key
        R.layers_info = layers
    return R.layers_info


def _build_after(token, md, self, common_prefix_len, common_attn_metadata, *a, **kw):
    if not R.in_execute:
        return  # warm-up and dummy runs are not engine steps
    num_reqs = common_attn_metadata.num_reqs
    n = md.num_actual_tokens
    qsl = md.query_start_loc[: num_reqs + 1].tolist()
    slots = md.slot_mapping[:n].tolist()
    if R.runner_pending is not None:
        R.runner_pending["slot_mapping"] = int_list(slots)
    capture.note_slots(slots)
    layout = None
    try:
        resolved = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        layout = str(getattr(resolved, "name", resolved))
    except Exception:
        pass
    R.write(
        AttentionRecord(
            step=R.worker_step,
            proc=R.proc("worker"),
            backend=type(self).__name__.removesuffix("MetadataBuilder"),
            layout=layout,
            num_reqs=num_reqs,
            seq_lens=md.seq_lens[:num_reqs].tolist(),
            query_lens=[b - a for a, b in zip(qsl, qsl[1:])],
            block_table=[_trim(row) for row in md.block_table[:num_reqs].tolist()],
            layers=_layers(self),
        )
    )


build = Probe(
    name="attention.build",
    target=f"{CPU_ATTN}.CPUAttentionMetadataBuilder.build",
    params=("self", "common_prefix_len", "common_attn_metadata"),
    records="backend, per-request sequence and query lengths, block-table rows the kernel receives, "
    "slot mapping, KV-cache layout and shape per layer",
    pins=PINS,
    after=_build_after,
    role="worker",
)

PROBES = [build]
