"""Probes on the MACA platform plugin's attention backends (vllm-metax at tag v0.21.0, pin v0.21.0).

vllm-metax registers its own classes under upstream's backend names
(`vllm_metax.platform.register_attention_backends`: TRITON_ATTN ->
`vllm_metax.v1.attention.backends.triton_attn.MacaTritonAttentionBackend`, FLASH_ATTN -> ...).
On MetaX hardware the engine builds attention metadata and runs attention in those
classes, never in upstream's, so the attention probes target them. They keep
upstream v0.21.0's signatures and KV-cache layouts, so the CUDA hooks record them.
Nothing here runs without MetaX hardware: `vllm-tour probes --pin v0.21.0 --platform
maca --source PATH` checks these declarations against the plugin's sources.
"""

from __future__ import annotations

from vllm_tour.probes.attention import build_probe
from vllm_tour.probes.capture import BLOCK_SELECT, forward_probe

PLATFORM = "maca"
PACKAGE = "vllm_metax"  # the package the plugin installs (its entry points live there)
PINS = ("v0.21.0",)
TRITON_ATTN = "vllm_metax.v1.attention.backends.triton_attn"
FLASH_ATTN = "vllm_metax.v1.attention.backends.flash_attn"
# The backend-class method that returns each probe's class: the static check follows it from the class the
# plugin registers for the backend, so a probe on a class the backend no longer uses fails there.
OWNER_METHOD = {"attention.build": "get_builder_cls", "capture.attention_forward": "get_impl_cls"}

PROBES = [
    build_probe("TRITON_ATTN", f"{TRITON_ATTN}.TritonAttentionMetadataBuilder.build", PINS, PLATFORM),
    build_probe("FLASH_ATTN", f"{FLASH_ATTN}.FlashAttentionMetadataBuilder.build", PINS, PLATFORM),
    forward_probe("TRITON_ATTN", f"{TRITON_ATTN}.TritonAttentionImpl.forward", BLOCK_SELECT["TRITON_ATTN"], PINS, PLATFORM),
    forward_probe("FLASH_ATTN", f"{FLASH_ATTN}.FlashAttentionImpl.forward", BLOCK_SELECT["FLASH_ATTN"], PINS, PLATFORM),
]
