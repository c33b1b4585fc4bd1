"""CPU KV-cache layouts: every ISA's layout decodes to the canonical one.

Checked two ways: against upstream's own writer (`_C.cpu_attn_reshape_and_cache`, on every
machine where its ISA runs) and against a synthetic layout built the way upstream's AMX
kernel reads its tiles (on every machine, AMX or not).
"""

import pytest
import torch

from vllm_tour.probes.kv_layout import AMX_PAIR, AMX_TILE_ROWS, UnknownKVLayout, cpu_canonical

HAS_AMX = torch.cpu._is_amx_tile_supported()
SHAPES = [(2, 2, 32, 64), (3, 1, 64, 128), (1, 4, 32, 128)]  # blocks, kv heads, block size, head dim


def _kv(nb, nh, bs, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(nb, nh, bs, d, generator=g).to(dtype)
    v = torch.randn(nb, nh, bs, d, generator=g).to(dtype)
    return k, v


def _upstream_write(k, v, isa):
    """Fill a CPU_ATTN cache through upstream's op, token by token in slot order."""
    pytest.importorskip("vllm._custom_ops")
    nb, nh, bs, d = k.shape
    cache = torch.zeros(nb, nh, bs, 2 * d, dtype=k.dtype)
    key_cache, value_cache = cache.view(nb, nh, 2 * bs, d).chunk(2, dim=2)
    tokens_k = k.permute(0, 2, 1, 3).reshape(nb * bs, nh, d)  # slot s of block b is token b*bs+s
    tokens_v = v.permute(0, 2, 1, 3).reshape(nb * bs, nh, d)
    torch.ops._C.cpu_attn_reshape_and_cache(tokens_k, tokens_v, key_cache, value_cache,
                                            torch.arange(nb * bs), isa, 1.0, 1.0, "auto")
    return cache


def _amx_pack(k, v):
    """The AMX layout, built from its definition: K is the B operand of the QK tile gemm
    (16 slots per tile, two consecutive head dims per 32-bit lane), V the B operand of the
    PV gemm (16 head dims per tile, two consecutive slots per lane)."""
    nb, nh, bs, d = k.shape
    r, p = AMX_TILE_ROWS, AMX_PAIR
    k_mem = torch.empty(nb, nh, bs // r, d // p, r, p, dtype=k.dtype)
    v_mem = torch.empty(nb, nh, d // r, bs // p, r, p, dtype=v.dtype)
    for s in range(bs):
        for j in range(d):
            k_mem[:, :, s // r, j // p, s % r, j % p] = k[:, :, s, j]
            v_mem[:, :, j // r, s // p, j % r, s % p] = v[:, :, s, j]
    return torch.cat([k_mem.reshape(nb, nh, -1), v_mem.reshape(nb, nh, -1)], dim=2).reshape(nb, nh, bs, 2 * d)


def _canonical(k, v):
    return torch.stack([k, v], dim=1)


@pytest.mark.parametrize("shape", SHAPES)
def test_amx_decoder_inverts_the_tile_packing(shape):
    k, v = _kv(*shape)
    assert torch.equal(cpu_canonical(_amx_pack(k, v), "amx"), _canonical(k, v))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_decoder_inverts_upstream_writer(isa, shape):
    if isa == "amx" and not HAS_AMX:
        pytest.skip("upstream's AMX writer runs only on a CPU with AMX tiles; the synthetic packing test covers it")
    k, v = _kv(*shape, dtype=torch.bfloat16 if isa == "amx" else torch.float32)
    written = _upstream_write(k, v, isa)
    assert torch.equal(cpu_canonical(written, isa), _canonical(k, v))
    if isa == "amx":  # and the synthetic packing is byte for byte what upstream writes
        assert torch.equal(written, _amx_pack(k, v))


def test_unknown_isa_is_refused_by_name():
    k, v = _kv(1, 1, 32, 64)
    with pytest.raises(UnknownKVLayout, match="'neon'"):
        cpu_canonical(torch.cat([k, v], dim=-1), "neon")
