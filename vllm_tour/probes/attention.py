"""Probes on the CPU attention backend (worker processes).

The metadata builder's output is exactly what the attention kernel receives:
sequence lengths, query offsets, block-table rows and the slot mapping.
"""

from __future__ import annotations

import numpy as np

from ..trace.writer import RECORDER as R
from . import capture
from .base import Probe
from .runner import int_list

PINS = ("v0.32.0",)
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"


def _trim_rows(table: np.ndarray) -> list[list[int]]:
    """Block-table rows without their trailing zeros.

    Rows are padded with 0, upstream's null block, which no request owns. Done
    in numpy: this runs every step over max_num_reqs x max_blocks entries.
    """
    bt = table
    if bt.size == 0:
        return [[] for _ in range(bt.shape[0])]
    nonzero = bt != 0
    widths = np.where(nonzero.any(axis=1), bt.shape[1] - np.argmax(nonzero[:, ::-1], axis=1), 0)
    rows = bt[:, : int(widths.max())].tolist()  # convert only the used columns
    return [row[:w] for row, w in zip(rows, widths.tolist())]


def _layers(builder) -> list[dict]:
    if R.layers_info is None:
        ctx = builder.vllm_config.compilation_config.static_forward_context
        layers, first = [], None
        for name in builder.layer_names:
            kv = getattr(ctx.get(name), "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0] if kv else None
            if kv is None or not hasattr(kv, "shape"):
                continue
            info = {"layer": name, "kv_cache_shape": list(kv.shape), "kv_cache_dtype": str(kv.dtype).replace("torch.", "")}  # schema.AttentionLayer
            key = (tuple(info["kv_cache_shape"]), info["kv_cache_dtype"])
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
    # CPU backend: the tensors live in host memory; numpy views slice far cheaper than torch.
    qsl = md.query_start_loc.numpy()[: num_reqs + 1].tolist()
    slots = md.slot_mapping.numpy()[:n].tolist()
    if R.runner_pending is not None:
        R.runner_pending["slot_mapping"] = int_list(slots)
    capture.note_slots(slots)
    R.write(  # a schema.AttentionRecord, as a dict (see Recorder.write)
        {
            "step": R.worker_step,
            "proc": R.proc_dict("worker"),
            "kind": "attention",
            "backend": type(self).__name__.removesuffix("MetadataBuilder"),
            "layout": _layout(self),
            "num_reqs": num_reqs,
            "seq_lens": md.seq_lens.numpy()[:num_reqs].tolist(),
            "query_lens": [b - a for a, b in zip(qsl, qsl[1:])],
            "block_table": _trim_rows(md.block_table.numpy()[:num_reqs]),
            "layers": _layers(self),
        }
    )


_layouts: dict[int, str | None] = {}


def _layout(builder) -> str | None:
    """The resolved KV-cache layout name (e.g. LBHNC), looked up once per config."""
    cfg = builder.vllm_config.cache_config
    if id(cfg) not in _layouts:
        try:
            resolved = cfg.get_resolved_kv_cache_layout()
            _layouts[id(cfg)] = str(getattr(resolved, "name", resolved))
        except Exception:
            _layouts[id(cfg)] = None
    return _layouts[id(cfg)]


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
