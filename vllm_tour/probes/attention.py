"""Probes on the attention backends (worker processes): CPU_ATTN (v0.32.0, CPU),
TRITON_ATTN and FLASH_ATTN (v0.21.0, CUDA). One declaration per backend and pin;
`install.probes_for` picks the one the engine runs (the pin profile's
default_attention_backend unless the scenario names `engine.attention_backend`).

The metadata builder's output is exactly what the attention kernel receives:
sequence lengths, query offsets, block-table rows and the slot mapping.
"""

from __future__ import annotations

import operator
from bisect import bisect_left

import numpy as np

from vllm_tour.probes import capture
from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.probes.runner import int_list
from vllm_tour.trace.writer import RECORDER as R

PINS = CPU_PINS
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
FLASH_ATTN = "vllm.v1.attention.backends.flash_attn"
CUDA_PINS = ("v0.21.0",)
# Which backend a pin runs by default, and each CUDA backend's KV-cache axis order, are the
# pin's profile (pins/<tag>.toml [profile]); CPU_ATTN's layout is read from the cache config.


def _np(t):
    """A tensor's values as numpy: a view on CPU, one copy from the GPU."""
    return t.numpy() if t.is_cpu else t.cpu().numpy()


FEW_ROWS = 32  # a decode step's changed rows: up to this many, row by row costs less than numpy's calls over them


def _trim_rows(table: np.ndarray, rows: list[int] | None = None) -> list[list[int]]:
    """Block-table rows (the listed ones, ascending, else all) without their trailing zeros.

    Rows are padded with 0, upstream's null block, which no request owns.
    """
    if rows is None:
        rows = range(len(table))
    if len(rows) <= FEW_ROWS or table.size == 0:  # row by row: no fancy indexing or per-call numpy costs
        # A row's bytes without their trailing zero bytes end inside its last non-zero block (little or big
        # endian alike: that block has a non-zero byte, all later blocks are zero): converted up to there only.
        size = table.itemsize
        return [row[: -(-len(row.tobytes().rstrip(b"\0")) // size)].tolist() for row in map(table.__getitem__, rows)]
    if len(rows) < len(table):
        table = table[rows]
    nonzero = table != 0
    widths = np.where(np.logical_or.reduce(nonzero, axis=1), table.shape[1] - nonzero[:, ::-1].argmax(axis=1), 0)
    trimmed = table[:, : int(np.maximum.reduce(widths))].tolist()  # convert only the used columns
    return list(map(operator.getitem, trimmed, map(slice, widths.tolist())))  # row[:w], without a Python loop


def _block_rows(table: np.ndarray, zero_rows: int = 0) -> dict:
    """The block-table fields of this step's attention record: the rows that differ
    from the previous record's (see schema.AttentionRecord.block_table_since).

    `table` holds the batch's rows; `zero_rows` more rows of 0 follow it (a CUDA graph's
    padding rows, zero on the GPU and stale on the host: never copied to be zeroed).
    In decode steps a few rows change per step (a request crossing a block boundary,
    a finished request's row refilled). The table is a view of the engine's buffer:
    the comparison base is a copy of the previous record's rows, kept across steps and
    updated in place on the changed rows (one pass over the table per step, no copy of it).
    """
    real, cols = table.shape
    num_rows = real + zero_rows
    prev = R.attn_prev_table
    if prev is None or prev[1].shape[1] != cols:
        base = np.zeros((num_rows, cols), table.dtype)
        base[:real] = table
        R.attn_prev_table = (R.worker_step, base, num_rows)
        return {"block_table": _trim_rows(table) + [[] for _ in range(zero_rows)], "block_table_since": None,
                "block_table_rows": None}
    since, base, seen = prev
    n = min(seen, real)
    # ufunc and method calls, not np.any / np.flatnonzero: their Python wrappers cost more than the work here
    rows = np.logical_or.reduce(table[:n] != base[:n], axis=1).nonzero()[0].tolist()
    if zero_rows and real < seen:  # padding now where the previous record had rows: changed unless those were 0
        rows += (np.logical_or.reduce(base[real : min(seen, num_rows)] != 0, axis=1).nonzero()[0] + real).tolist()
    rows.extend(range(seen, num_rows))  # rows the previous record did not have
    if len(base) < num_rows:
        base = np.concatenate([base, np.zeros((num_rows - len(base), cols), base.dtype)])
    cut = bisect_left(rows, real)  # rows[:cut] are the batch's, the rest padding
    if cut:
        base[rows[:cut]] = table[rows[:cut]]
    if cut < len(rows):
        base[rows[cut:]] = 0
    R.attn_prev_table = (R.worker_step, base, num_rows)
    trimmed = _trim_rows(table, rows[:cut]) + [[] for _ in range(len(rows) - cut)]
    return {"block_table": trimmed, "block_table_since": since, "block_table_rows": rows}


def _host_tables(md, pending: dict | None):
    """(runner, request index per token, positions) left by runner.py's prepare_inputs probe
    when the kernel's slot mapping and block table follow from the runner's host state: CUDA,
    one KV-cache group, no context parallelism. None: read the metadata's own tensors."""
    host = pending.get("host") if pending is not None else None
    if host is None or md.slot_mapping.is_cpu:
        return None
    tables = host[0].input_batch.block_table.block_tables
    if len(tables) != 1 or getattr(tables[0], "pcp_world_size", 1) * getattr(tables[0], "dcp_world_size", 1) != 1:
        return None
    return host


def _host_view(host, cm, num_reqs: int, n: int):
    """Slot mapping, block-table rows and sequence lengths as v0.21.0 computes them on the GPU
    (block_table._compute_slot_mapping_kernel: block id * block size + offset, PAD_SLOT_ID -1
    past the scheduled tokens), from the host copies it computes them from: (slots, the
    batch's block-table rows, how many rows of 0 follow them, sequence lengths). Rows past
    the batch (CUDA-graph padding) hold the null block 0 on the GPU, stale rows on the host."""
    runner, req_indices, positions = host
    bt = runner.input_batch.block_table.block_tables[0]
    batch = min(runner.input_batch.num_reqs, num_reqs)
    table = bt.block_table.np[:batch]
    size = bt.block_size
    index, offset = np.divmod(positions, size)
    slots = bt.block_table.np[req_indices, index].astype(np.int64)
    slots *= size
    slots += offset
    if n > len(slots):  # tokens past the scheduled ones (padding): PAD_SLOT_ID
        slots = np.concatenate([slots, np.full(n - len(slots), -1, np.int64)])
    seq_lens = cm._seq_lens_cpu if getattr(cm, "_seq_lens_cpu", None) is not None else runner.optimistic_seq_lens_cpu
    return slots, table, num_reqs - batch, seq_lens.numpy()[:num_reqs]


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


def _build_after(token, md, self, common_prefix_len, common_attn_metadata, *a, layout=None, **kw):
    if not R.in_execute:
        return  # warm-up and dummy runs are not engine steps
    num_reqs = common_attn_metadata.num_reqs
    n = md.num_actual_tokens
    # CPU backend: the tensors live in host memory; numpy views slice far cheaper than torch.
    # The query offsets' host copy (both pins keep one) spares a CUDA run a device-to-host sync.
    qsl = _np(common_attn_metadata.query_start_loc_cpu)[: num_reqs + 1]
    host = _host_tables(md, R.runner_pending)
    if host is None:
        slots = _np(md.slot_mapping)[:n]
        table, zero_rows = _np(md.block_table)[:num_reqs], 0
        seq_lens = _np(md.seq_lens)[:num_reqs]
    else:
        slots, table, zero_rows, seq_lens = _host_view(host, common_attn_metadata, num_reqs, n)
    if R.runner_pending is not None:
        R.runner_pending["slot_mapping"] = int_list(slots)
    if R.capture:
        capture.note_slots(slots.tolist())
    R.write(  # a schema.AttentionRecord, as a dict (see Recorder.write)
        {
            "step": R.worker_step,
            "proc": R.proc_dict("worker"),
            "kind": "attention",
            "backend": type(self).__name__.removesuffix("MetadataBuilder"),
            "layout": layout or _layout(self),
            "isa": getattr(self, "isa", None),
            "num_reqs": num_reqs,
            "seq_lens": seq_lens.tolist(),
            "query_lens": (qsl[1:] - qsl[:-1]).tolist(),
            **_block_rows(table, zero_rows),
            "layers": _layers(self),
            "num_layers": len(self.layer_names),
            "num_kv_heads": getattr(getattr(self, "kv_cache_spec", None), "num_kv_heads", None),
            "head_size": getattr(getattr(self, "kv_cache_spec", None), "head_size", None),
        },
        flush=False,  # the runner record completes the step: one write() for both
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
    "slot mapping, KV-cache layout and shape per layer, layer count, KV heads and head size",
    pins=PINS,
    after=_build_after,
    role="worker",
    backend="CPU_ATTN",
)


def _profile_layout(backend: str) -> str | None:
    from vllm_tour.probes.run_env import current_pin
    from vllm_tour.upstream import pins

    return pins.pin_profile(current_pin()).kv_layouts.get(backend)


def build_probe(backend: str, target: str, pins: tuple[str, ...] = CUDA_PINS, platform: str | None = None) -> Probe:
    """v0.21.0's CUDA builders (and MACA's, which keep their signature):
    build(self, common_prefix_len, common_attn_metadata, fast_build=False)."""

    layout: list[str | None] = []  # the pin profile's, read once: a process runs one pin

    def after(token, md, self, common_prefix_len, common_attn_metadata, *a, **kw):
        kw.pop("fast_build", None)
        if not layout:
            layout.append(_profile_layout(backend))
        _build_after(token, md, self, common_prefix_len, common_attn_metadata, layout=layout[0])

    return Probe(
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


PROBES = [
    build,
    build_probe("TRITON_ATTN", f"{TRITON_ATTN}.TritonAttentionMetadataBuilder.build"),
    build_probe("FLASH_ATTN", f"{FLASH_ATTN}.FlashAttentionMetadataBuilder.build"),
]
