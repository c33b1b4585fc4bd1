"""`vllm-tour doctor --pin v0.21.0` on the GPU machine: the carried (trimmed) install and a +cu130 torch pass."""

from __future__ import annotations

from vllm_tour.upstream import doctor
from vllm_tour.upstream.pins import load_pin, source_digest


def _checks(monkeypatch, tmp_path, files: dict[str, str], torch: str):
    root = tmp_path / "vllm"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(doctor, "current_platform_name", lambda: "cuda")
    monkeypatch.setattr(doctor, "installed_vllm", lambda: None)
    monkeypatch.setattr(doctor, "torch_version", lambda: torch)
    monkeypatch.setattr(doctor, "gpu_info", lambda: "NVIDIA H200")
    pin = load_pin("v0.21.0")
    digest, n = source_digest(root)
    dist = pin.distributions["cuda"].model_copy(update={"carried_source_digest": digest, "carried_source_files": n})
    pin = pin.model_copy(update={"distributions": {"cuda": dist}})
    return {c.what: c for c in doctor.run_checks(pin, vllm_root=root)}, pin


def test_carried_digest_and_cuda_torch_build_pass(monkeypatch, tmp_path):
    checks, _ = _checks(monkeypatch, tmp_path, {"__init__.py": "x = 1\n"}, "2.11.0+cu130")
    assert checks["vLLM source digest"].ok is True
    assert "carried payload" in checks["vLLM source digest"].found
    assert checks["torch"].ok is True and checks["platform"].ok is True


def test_other_sources_or_torch_still_mismatch(monkeypatch, tmp_path):
    checks, pin = _checks(monkeypatch, tmp_path, {"__init__.py": "x = 1\n"}, "2.10.0+cu128")
    assert checks["torch"].ok is False
    (tmp_path / "vllm" / "__init__.py").write_text("x = 2\n")  # edited after the digest was taken
    checks = {c.what: c for c in doctor.run_checks(pin, vllm_root=tmp_path / "vllm")}
    assert checks["vLLM source digest"].ok is False


def test_v0210_pin_records_the_carried_payload():
    d = load_pin("v0.21.0").distributions["cuda"]
    assert d.carried_source_digest.startswith("sha256:") and d.carried_source_files == 1764
