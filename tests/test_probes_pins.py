"""Probe declarations per pin and attention backend; v0.21.0 checked statically against its sources.

v0.21.0 is a CUDA wheel that cannot be imported here, so its targets are resolved
in the pin's source tree (libcst) with their leading parameters: a target missing
on v0.21.0 fails in CI, not on the GPU machine.
"""

import dataclasses
from pathlib import Path

import pytest

from vllm_tour.errors import TourError
from vllm_tour.probes import install as inst
from vllm_tour.probes.static import check_static


@pytest.fixture(scope="module")
def tree_v0210():
    from vllm_tour.notes.pinned import tree_for_pin

    return tree_for_pin("v0.21.0")


@pytest.mark.fetches_wheel  # downloads vllm==0.21.0's wheel once (cached), as test_source_cli does
def test_every_v0210_target_resolves_in_its_sources(tree_v0210):
    assert check_static("v0.21.0", tree_v0210) == []
    names = {p.name for p in inst.probes_for("v0.21.0")}
    assert names >= {"scheduler.schedule", "scheduler.preempt", "kv.free", "kv.evict",
                     "runner.execute_model", "runner.prepare_inputs", "runner.sample_tokens", "attention.build",
                     "capture.attention_forward"}
    for backend in ("TRITON_ATTN", "FLASH_ATTN"):
        assert check_static("v0.21.0", tree_v0210, backends=[backend]) == []


@pytest.mark.fetches_wheel
def test_static_check_catches_a_missing_target_and_a_changed_signature(tree_v0210):
    build = next(p for p in inst.probes_for("v0.21.0") if p.name == "attention.build")
    gone = dataclasses.replace(build, target=build.target + "_v9")
    renamed = dataclasses.replace(build, params=("self", "common_prefix_len", "metadata"))
    probs = check_static("v0.21.0", tree_v0210, backends=["TRITON_ATTN"], probes=[gone])
    assert len(probs) == 1 and "TritonAttentionMetadataBuilder.build_v9 not found on pin v0.21.0" in probs[0]
    probs = check_static("v0.21.0", tree_v0210, backends=["TRITON_ATTN"], probes=[renamed])
    assert "expected (self, common_prefix_len, metadata" in probs[0]
    assert "its after hook cannot take (self, common_prefix_len, metadata) by keyword" in probs[1]
    # v0.32.0's CPU backend module is no target on v0.21.0's declarations
    assert all("cpu_attn" not in p.target for p in inst.probes_for("v0.21.0"))


def test_static_check_agrees_with_import_on_the_installed_pin():
    from vllm_tour.upstream.pins import pin_sources
    from vllm_tour.notes.resolve import SourceTree

    assert check_static("v0.32.0", SourceTree(pin_sources("v0.32.0"), "pin v0.32.0")) == []


def test_attention_probes_are_chosen_by_pin_and_backend():
    def target(pin, backend=None):
        return next(p.target for p in inst.probes_for(pin, backend) if p.name == "attention.build")

    assert target("v0.32.0").endswith("cpu_attn.CPUAttentionMetadataBuilder.build")
    assert target("v0.21.0").endswith("triton_attn.TritonAttentionMetadataBuilder.build")
    assert target("v0.21.0", "FLASH_ATTN").endswith("flash_attn.FlashAttentionMetadataBuilder.build")
    with pytest.raises(TourError, match="pin v0.32.0 has probes for the attention backends CPU_ATTN .*not FLASH_ATTN"):
        inst.probes_for("v0.32.0", "FLASH_ATTN")


@pytest.mark.parametrize("tag", ["v0.32.0", "v0.21.0"])
def test_each_backend_a_pin_profile_lists_has_its_probes_declared(tag):
    """The profile's probe target set and the declarations agree: every backend-specific probe
    has a declaration checked against this pin, for every backend the profile lists."""
    from vllm_tour.upstream.pins import pin_profile

    profile = pin_profile(tag)
    assert profile.default_attention_backend in profile.attention_backends
    backend_specific = {p.name for p in inst.PROBES if p.backend}
    for backend in profile.attention_backends:
        chosen = [p for p in inst.probes_for(tag, backend) if p.backend]
        assert {p.name for p in chosen} == backend_specific and all(tag in p.pins for p in chosen)


def test_engine_kwargs_per_pin():
    from vllm_tour.scenario import scenario_from_dict
    from vllm_tour.engine.run import engine_kwargs

    sc = scenario_from_dict({"name": "t", "requests": [{"id": "r0", "prompt": "hi"}]})
    cpu = engine_kwargs(sc, Path("/m"), "v0.32.0")
    assert "attention_config" not in cpu and "async_scheduling" not in cpu  # v0.32.0 on CPU: as before
    cuda = engine_kwargs(sc, Path("/m"), "v0.21.0")
    assert cuda["attention_config"] == {"backend": "TRITON_ATTN"} and cuda["async_scheduling"] is False
    sc.engine.attention_backend = "FLASH_ATTN"
    assert engine_kwargs(sc, Path("/m"), "v0.21.0")["attention_config"] == {"backend": "FLASH_ATTN"}


def test_moe_probes_pick_each_pins_experts_kernel():
    """v0.21.0 (CUDA) records MoE routing at the Triton experts kernel and its runner's (layer, hidden, logits)
    call; v0.32.0 at the CPU kernel. The layer index comes from v0.21.0's layer name (its runner has no layer_id)."""
    from types import SimpleNamespace

    from vllm_tour.probes import moe

    def moe_targets(pin):
        return {p.name: (p.target, p.params) for p in inst.probes_for(pin) if p.name.startswith("moe.")}

    cuda, cpu = moe_targets("v0.21.0"), moe_targets("v0.32.0")
    assert cuda["moe.triton_experts"][0].endswith("triton_moe.TritonExperts.apply") and "moe.cpu_experts" not in cuda
    assert cpu["moe.cpu_experts"][0].endswith("cpu_moe.CPUUnquantizedExperts.apply") and "moe.triton_experts" not in cpu
    assert cuda["moe.apply_quant_method"][1][:4] == ("self", "layer", "hidden_states", "router_logits")
    assert cpu["moe.apply_quant_method"][1][:3] == ("self", "hidden_states", "router_logits")
    assert "moe.reduce_final_output" in cuda and "moe.reduce_final_output" in cpu
    assert moe._layer_id(SimpleNamespace(layer_name="model.layers.7.mlp.experts")) == 7
    assert moe._layer_id(SimpleNamespace(layer_id=3, layer_name="x")) == 3


def test_static_check_catches_a_hook_that_cannot_take_its_target_arguments_by_keyword(monkeypatch):
    """v0.21.0's MoE runner calls `_apply_quant_method(layer=..., hidden_states=..., router_logits=...)`: a hook
    naming those parameters otherwise raised TypeError on every call and left every MoE record with layer -1."""
    from vllm_tour.probes import moe
    from vllm_tour.probes.static import hook_problems

    assert all(hook_problems(p) == [] for p in inst.PROBES)
    renamed = dataclasses.replace(moe.apply_quant_method_v0210,
                                  before=lambda self, layer, hidden, logits, *a, **kw: None)
    probs = hook_problems(renamed)
    assert len(probs) == 1 and "before hook cannot take (self, layer, hidden_states, router_logits) by keyword" in probs[0]
    calls = []
    runner = type("Runner", (), {"layer_name": "model.layers.3.mlp.experts"})()
    from vllm_tour.trace.writer import RECORDER

    monkeypatch.setattr(RECORDER, "keep_capture", lambda name, t: calls.append(name))
    moe.apply_quant_method_v0210.before(runner, layer=None, hidden_states=None, router_logits=None)
    assert moe._layer[0] == 3 and calls == ["router_logits.layers.3"]
