"""MACA (vllm-metax) as a static target: its pinned sources, the platform plugin doctor finds, the static check.

The plugin's v0.21.0 sources are checked in (tests/data/maca, 250 KB, Apache-2.0, its LICENSE inside):
no registry these machines reach has it and CI runs on a clean clone, where ../shared/maca may be absent.
"""

import ast
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from vllm_tour.upstream import doctor, pins
from vllm_tour.errors import TourError
from vllm_tour.platforms.check import check_plugin
from vllm_tour.probes import install as inst

DATA = Path(__file__).parent / "data" / "maca"
TARBALL = DATA / "vllm-metax-v0.21.0-py.tar.xz"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "maca" / TARBALL.name
TRITON = "vllm_metax/v1/attention/backends/triton_attn.py"
BUILD = "vllm_metax.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.build"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The plugin's sources extracted once (tests edit copies of them)."""
    d = tmp_path_factory.mktemp("maca") / "vllm-metax"
    with tarfile.open(TARBALL) as tar:
        tar.extractall(d, filter="data")
    return d


@pytest.fixture(scope="module")
def tree_v0210():
    from vllm_tour.notes.pinned import tree_for_pin

    return tree_for_pin("v0.21.0")


def _copy(sources, tmp_path) -> Path:
    d = tmp_path / "plugin"
    shutil.copytree(sources, d)
    return d


def test_pin_records_the_checked_in_sources(sources):
    maca = pins.load_pin("v0.21.0").distributions["maca"]
    assert (maca.dist, maca.tag, maca.status) == ("vllm-metax", "v0.21.0", "static only (no hardware)")
    assert pins.source_digest(sources / "vllm_metax") == (maca.source_digest, maca.source_files)
    assert "maca" not in pins.load_pin("v0.32.0").distributions  # no vllm-metax release for 0.32 is known
    if SHARED.exists():  # the copy the project was given: the checked-in one is byte-identical
        assert SHARED.read_bytes() == TARBALL.read_bytes()


@pytest.mark.fetches_wheel  # v0.21.0's sources: downloaded once into the user cache, as test_probes_pins does
def test_static_check_of_the_pinned_plugin_exits_0(cli):
    r = cli("probes", "--pin", "v0.21.0", "--platform", "maca", "--source", TARBALL, "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] and "the pinned sources" in rep["findings"][0]["detail"]
    eps = {(e["group"], e["name"]): e["value"] for e in rep["entry_points"]}
    assert eps[("vllm.platform_plugins", "metax")] == "vllm_metax:register"
    assert eps[("vllm.general_plugins", "metax_enhanced_customized")] == "vllm_metax:register_customized"
    backends = {b["name"]: b["class_path"] for b in rep["backends"]}
    assert backends["TRITON_ATTN"] == "vllm_metax.v1.attention.backends.triton_attn.MacaTritonAttentionBackend"
    assert backends["FLASH_ATTN"] == "vllm_metax.v1.attention.backends.flash_attn.MacaFlashAttentionBackend"
    patches = {p["target"]: p for p in rep["patches"]}
    reorder = patches["vllm.v1.worker.gpu_model_runner.GPUModelRunner._may_reorder_batch"]
    assert reorder["applied_by"] == ["metax_enhanced_customized = vllm_metax:register_customized"]
    assert patches["vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p"]["applied_by"]
    # patch/bugfix/__init__.py comments out `from . import dp_fix`: its patches (of modules v0.21.0 lacks) never run
    assert patches["vllm.model_executor.layers.fused_moe.shared_fused_moe.SharedFusedMoE.forward"]["applied_by"] == []
    checked = {(f["check"], f["subject"]): f for f in rep["findings"]}
    assert checked[("probe", BUILD)]["ok"] and checked[("probe", "attention.build (FLASH_ATTN)")]["ok"]
    added = checked[("patch", "vllm.model_executor.layers.fused_moe.config.FusedMoEQuantConfig.use_int4_w4a8")]
    assert added["ok"] is None and "adds it" in added["detail"]
    assert rep["replaced"] == []  # no probe target is patched by this plugin at this tag


def test_a_backend_without_its_probed_method_exits_1_naming_it(sources, tmp_path, cli):
    d = _copy(sources, tmp_path)
    f = d / TRITON
    text = f.read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "TritonAttentionMetadataBuilder")
    build = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "build")
    lines = text.splitlines(keepends=True)
    f.write_text("".join(lines[: build.lineno - 1] + lines[build.end_lineno :]))
    r = cli("probes", "--pin", "v0.21.0", "--platform", "maca", "--source", d)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr
    failed = [l for l in r.stdout.splitlines() if l.startswith("FAILED")]
    assert len(failed) == 1 and BUILD in failed[0] and "not found" in failed[0], failed


def test_a_patch_of_what_the_pin_lacks_and_a_backend_class_the_probes_miss_fail(sources, tmp_path, tree_v0210):
    d = _copy(sources, tmp_path)
    perf = d / "vllm_metax/patch/performance/speculative_decode_perf.py"
    perf.write_text(perf.read_text().replace("from vllm.v1.worker.gpu_model_runner import", "from vllm.v1.worker.gpu_runner_v9 import"))
    f = d / TRITON
    f.write_text(f.read_text().replace("        return TritonAttentionMetadataBuilder\n", "        return MacaBuilder\n"))
    rep = check_plugin("maca", "v0.21.0", d, tree_v0210)
    failed = {(x.check, x.subject): x.detail for x in rep.failures()}
    assert set(failed) == {("patch", "vllm.v1.worker.gpu_runner_v9.GPUModelRunner._may_reorder_batch"),
                           ("probe", "attention.build (TRITON_ATTN)")}
    assert "not on pin v0.21.0" in failed[("patch", "vllm.v1.worker.gpu_runner_v9.GPUModelRunner._may_reorder_batch")]
    assert "get_builder_cls() returns no single name" in failed[("probe", "attention.build (TRITON_ATTN)")]
    assert "not the pinned sources" in rep.findings[0].detail
    assert rep.replaced == []


def test_a_patch_of_a_probe_target_is_named_as_replaced(sources, tmp_path, tree_v0210):
    d = _copy(sources, tmp_path)
    perf = d / "vllm_metax/patch/performance/speculative_decode_perf.py"
    perf.write_text(perf.read_text() + "GPUModelRunner.execute_model = MacaGPUModelRunner._may_reorder_batch\n")
    rep = check_plugin("maca", "v0.21.0", d, tree_v0210)
    target = "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model"
    assert rep.replaced == [target] and not rep.failures()
    [f] = [f for f in rep.findings if f.check == "replaced"]
    assert f.subject == target and "speculative_decode_perf.py:" in f.detail and "runner.execute_model" in f.detail


def test_bad_plugin_sources_are_one_line_exit_2(sources, tmp_path, cli, tree_v0210):
    junk = tmp_path / "junk.tar.xz"
    junk.write_bytes(b"not a tarball")
    r = cli("probes", "--pin", "v0.21.0", "--platform", "maca", "--source", junk)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a readable tarball" in r.stderr, r.stderr
    d = _copy(sources, tmp_path)
    (d / "vllm_metax/platform.py").write_text("def register(:\n")
    with pytest.raises(TourError, match="vllm_metax/platform.py does not parse"):
        check_plugin("maca", "v0.21.0", d, tree_v0210)
    with pytest.raises(TourError, match="unknown platform 'ascend'"):
        check_plugin("ascend", "v0.21.0", d, tree_v0210)
    with pytest.raises(TourError, match="pin v0.32.0 names no maca distribution"):
        check_plugin("maca", "v0.32.0", TARBALL)


def test_probes_per_platform_target_the_plugins_classes():
    upstream = {p.name: p.target for p in inst.probes_for("v0.21.0", "TRITON_ATTN")}
    macas = {p.name: p.target for p in inst.probes_for("v0.21.0", "TRITON_ATTN", platform="maca")}
    assert upstream["attention.build"].startswith("vllm.v1.attention.backends.triton_attn.")
    assert macas["attention.build"] == BUILD and macas["scheduler.schedule"] == upstream["scheduler.schedule"]
    with pytest.raises(TourError, match="no declaration for attention backend CPU_ATTN of platform maca"):
        inst.probes_for("v0.32.0", "CPU_ATTN", platform="maca")


def _fake_dist(site: Path, version: str, package_from: Path | None) -> None:
    """A dist-info that declares vllm-metax's platform entry point (and its package, when given)."""
    info = site / f"vllm_metax-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm_metax\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[vllm.platform_plugins]\nmetax = vllm_metax:register\n")
    if package_from is not None:
        shutil.copytree(package_from, site / "vllm_metax")


def test_doctor_reports_installed_platform_plugins_against_the_pin(sources, tmp_path, monkeypatch):
    pin = pins.load_pin("v0.21.0")
    rows = doctor.plugin_checks(pin)
    assert [(c.what, c.found, c.ok) for c in rows] == [("platform plugins", "none installed", None)]
    assert "vllm-metax 0.21.0 (maca: static only (no hardware))" in rows[0].expected
    site = tmp_path / "site"
    _fake_dist(site, "0.21.0", sources / "vllm_metax")
    monkeypatch.syspath_prepend(str(site))
    inst.current_platform.cache_clear()
    try:
        assert inst.current_platform() == "maca" and pins.current_platform_name() == "maca"
    finally:
        inst.current_platform.cache_clear()
    rows = {c.what: c for c in doctor.plugin_checks(pin)}
    assert rows["platform plugin"].ok and rows["platform plugin"].found == "metax = vllm_metax:register (vllm_metax 0.21.0)"
    assert rows["platform plugin source digest"].ok
    (site / "vllm_metax" / "envs.py").write_text("# changed\n")
    assert doctor.plugin_checks(pin)[1].ok is False
    # the v0.32.0 pin names no platform plugin: an installed one is a mismatch there
    assert [c.ok for c in doctor.plugin_checks(pins.load_pin("v0.32.0"))] == [False]
