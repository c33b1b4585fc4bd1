"""Probes on the attention backends (worker processes): CPU_ATTN (v0.32.0, CPU),
TRITON_ATTN and FLASH_ATTN (v0.21.0, CUDA). One declaration per backend and pin;
`install.probes_for` picks the one the engine runs (the pin profile's
default_attention_backend unless the scenario names `engine.attention_backend`).

The metadata builder's output is exactly what the attention kernel receives:
sequence lengths, query offsets, block-table rows and the slot mapping.
"""

from __future__ import annotations

import numpy as np

from ..trace.writer import RECORDER as R
from . import capture
from .base import Probe

PINS = ("v0.32.0",)
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
FLASH_ATTN = "vllm.v1.attention.backends.flash_attn"
CUDA_PINS = ("v0.21.0",)
# Which backend a pin runs by default, and each CUDA backend's KV-cache axis order, are the
# pin's profile (pins/<tag>.toml [profile]); CPU_ATTN's layout is read from the cache config.


def _np(t):
    """A tensor's values as numpy: a view on CPU, one copy from the GPU."""
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def _host_block_table(md):
    """The runner's block table when the kernel's slot mapping and block-table rows follow from the runner's
    host state (see worker_records): CUDA, one KV-cache group, no context parallelism. None: read the
    metadata's own tensors."""
    runner = R.host_runner
    if runner is None or md.slot_mapping.is_cpu:
        return None
    tables = runner.input_batch.block_table.block_tables
    if len(tables) != 1 or getattr(tables[0], "pcp_world_size", 1) * getattr(tables[0], "dcp_world_size", 1) != 1:
        return None
    return tables[0]


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


def _build_after(token, md, self, common_prefix_len, common_attn_metadata, *a, layout=None, probe=None, **kw):
    if not R.in_execute:
        return  # warm-up and dummy runs are not engine steps
    cm = common_attn_metadata
    num_reqs = cm.num_reqs
    n = md.num_actual_tokens
    static = R.attn_static.get(id(self)) or _static(self, layout, probe or build)
    # The query offsets' host copy (both pins keep one) spares a CUDA run a device-to-host sync.
    qsl = _np(cm.query_start_loc_cpu)[: num_reqs + 1]
    bt = _host_block_table(md)
    if bt is None:
        # CPU backend: the tensors live in host memory; numpy views slice far cheaper than torch.
        table = _np(md.block_table)[:num_reqs]
        header = ["attention", R.proc_dict("worker"), R.worker_step, static, num_reqs, n, 0, num_reqs, 0, table.shape[1], table.shape[1]]
        arrays = [qsl, _np(md.seq_lens)[:num_reqs], table, _np(md.slot_mapping)[:n]]
    else:
        tail, arrays = _host_arrays(R.host_runner, bt, cm, num_reqs)
        header = ["attention", R.proc_dict("worker"), R.worker_step, static, num_reqs, n, *tail]
        arrays.insert(0, qsl)
    R.send(header, arrays)  # the runner record that completes the step flushes both
    if R.capture:  # no helper then: the record was made here
        capture.note_slots(R.worker.slots.tolist())


def _host_arrays(runner, bt, cm, num_reqs: int) -> tuple[list, list]:
    """v0.21.0 on CUDA: an attention message's host-mode fields (block size, batch rows, padding rows, row
    length, columns sent) and arrays: the sequence lengths' host copy and the block-table rows the GPU copy
    was made from (the batch's; rows past it, a CUDA graph's padding, are 0 on the GPU and stale here).

    Only the columns a block id was ever written to are sent (the rest are 0): upstream writes a row's ids
    at its first num_blocks_per_row columns and leaves older ids past them (stale, but what the GPU gets),
    so every non-zero lies left of the widest row seen so far, at any step since the table was first read."""
    rows = runner.input_batch.num_reqs
    batch = min(rows, num_reqs)
    seq_lens = cm._seq_lens_cpu if getattr(cm, "_seq_lens_cpu", None) is not None else runner.optimistic_seq_lens_cpu
    table = bt.block_table.np
    width = R.attn_width.get(id(table))
    if width is None:  # first read: the columns holding any id now
        used = np.logical_or.reduce(table != 0, axis=0).nonzero()[0]
        width = int(used[-1]) + 1 if len(used) else 0
    width = R.attn_width[id(table)] = max(width, int(bt.num_blocks_per_row.max()))
    fields = [bt.block_size, batch, num_reqs - batch, table.shape[1], width]
    return fields, [seq_lens.numpy()[:num_reqs], table[:rows, :width]]


def _static(builder, layout: str | None, probe: Probe) -> list:
    """The attention record's fields that do not change between steps, then the probe's name and target
    (a probe error raised while the record is made names them)."""
    spec = getattr(builder, "kv_cache_spec", None)
    static = R.attn_static[id(builder)] = [
        type(builder).__name__.removesuffix("MetadataBuilder"), layout or _layout(builder), getattr(builder, "isa", None),
        _layers(builder), len(builder.layer_names), getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None),
        probe.name, probe.target,
    ]
    return static


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
    "slot mapping, KV-cache layout and shape per layer, layer count, KV heads and head size",
    pins=PINS,
    after=_build_after,
    role="worker",
    backend="CPU_ATTN",
)


def _profile_layout(backend: str) -> str | None:
    from .. import pins
    from .install import current_pin

    return pins.pin_profile(current_pin()).kv_layouts.get(backend)


def build_probe(backend: str, target: str, pins: tuple[str, ...] = CUDA_PINS, platform: str | None = None) -> Probe:
    """v0.21.0's CUDA builders (and MACA's, which keep their signature):
    build(self, common_prefix_len, common_attn_metadata, fast_build=False)."""

    layout: list[str | None] = []  # the pin profile's, read once: a process runs one pin

    def after(token, md, self, common_prefix_len, common_attn_metadata, *a, **kw):
        kw.pop("fast_build", None)
        if not layout:
            layout.append(_profile_layout(backend))
        _build_after(token, md, self, common_prefix_len, common_attn_metadata, layout=layout[0], probe=probe)

    probe = Probe(
        name="attention.build",
        target=target,
        params=("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
        records=build.records,
        pins=pins,
        after=after,
        role="worker",
        backend=backend,
        platform=platform,
    )
    return probe


PROBES = [
    build,
    build_probe("TRITON_ATTN", f"{TRITON_ATTN}.TritonAttentionMetadataBuilder.build"),
    build_probe("FLASH_ATTN", f"{FLASH_ATTN}.FlashAttentionMetadataBuilder.build"),
]
