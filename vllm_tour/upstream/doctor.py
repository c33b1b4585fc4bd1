"""Doctor: is this environment the one a pin describes?

Every check yields a row (what, expected, found, ok). The CLI prints them as a
table and exits 2 with one line per mismatch, so a course author knows at
once whether a trace taken here is true to the pin.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_tour.upstream.pins import Pin, current_platform_name, installed_vllm, source_digest, torch_version

PLATFORM_PLUGINS_GROUP = "vllm.platform_plugins"  # vllm.plugins.PLATFORM_PLUGINS_GROUP, read without importing vLLM


@dataclass
class Check:
    what: str
    expected: str
    found: str
    ok: bool | None  # None: informational, never a mismatch


def gpu_info() -> str:
    """GPU name, driver and memory via NVML; "no GPU" when NVML finds none."""
    try:
        import pynvml
    except ImportError:
        return "no GPU (nvidia-ml-py not installed)"
    try:
        pynvml.nvmlInit()
    except Exception:
        return "no GPU"
    try:
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            return "no GPU"
        driver = pynvml.nvmlSystemGetDriverVersion()
        names = []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            names.append(f"{pynvml.nvmlDeviceGetName(h)} ({mem:.0f} GiB)")
        return f"{n}× " + ", ".join(sorted(set(names))) + f", driver {driver}"
    finally:
        pynvml.nvmlShutdown()


def run_checks(pin: Pin, vllm_root: Path | None = None) -> list[Check]:
    """Compare the installed vLLM (or the tree at `vllm_root`) with `pin`."""
    checks: list[Check] = []
    inst = installed_vllm()
    plat = current_platform_name()
    dist = pin.distributions.get(plat)
    if inst is None and vllm_root is None:
        checks.append(Check("vLLM", f"{pin.version}", "not installed", False))
    else:
        if inst is not None:
            want = f"{dist.dist} {dist.version}" if dist else f"vllm {pin.version}"
            checks.append(Check("vLLM distribution", want, f"{inst.dist} {inst.version}",
                                inst.version == pin.version and (dist is None or inst.dist == dist.dist)))
        root = vllm_root or inst.path
        digest, nfiles = source_digest(root)
        carried = dist is not None and dist.carried_source_digest is not None and digest == dist.carried_source_digest
        found = f"{digest} ({nfiles} files)" + (f"; the carried payload: {dist.carried_note}" if carried else "")
        checks.append(Check("vLLM source digest", f"{pin.source_digest} ({pin.source_files} files)",
                            found, digest == pin.source_digest or carried))
    tv = torch_version() or "not installed"
    want_torch = dist.torch if dist and dist.torch else pin.torch
    # A pin without a local version ("2.11.0") accepts any build of it ("2.11.0+cu130").
    checks.append(Check("torch", want_torch, tv, tv == want_torch or ("+" not in want_torch and tv.split("+")[0] == want_torch)))
    want_plat = ", ".join(sorted(pin.distributions))
    checks.append(Check("platform", want_plat, plat, plat in pin.distributions))
    if dist is not None and dist.status != "tested":
        checks.append(Check("platform status", "tested", dist.status, None))
    checks += plugin_checks(pin)
    checks.append(Check("Python", "", platform.python_version(), None))
    checks.append(Check("commit", pin.commit or f"none ({pin.commit_note})", "", None))
    checks.append(Check("GPU", "", gpu_info(), None))
    return checks


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class PlatformPlugin:
    entry_point: str  # "metax = vllm_metax:register"
    dist: str | None  # the distribution that declares it
    version: str | None
    package: Path | None  # the top-level package its entry point imports, where installed


def platform_plugins() -> list[PlatformPlugin]:
    """The installed `vllm.platform_plugins` entry points (what vLLM's platform resolution loads), without importing them."""
    out = []
    for ep in importlib.metadata.entry_points(group=PLATFORM_PLUGINS_GROUP):
        d = ep.dist
        top = ep.value.split(":")[0].split(".")[0]
        init = Path(d.locate_file(f"{top}/__init__.py")) if d is not None else None
        out.append(PlatformPlugin(f"{ep.name} = {ep.value}", d.metadata["Name"] if d else None, d.version if d else None,
                                  init.parent if init is not None and init.exists() else None))
    return sorted(out, key=lambda p: p.entry_point)


def plugin_checks(pin: Pin) -> list[Check]:
    """Installed platform plugins against the pin's plugin distributions (MACA: vllm-metax).

    None installed is no mismatch (vLLM then resolves a built-in platform); an installed plugin the
    pin does not name, or another version or source digest of one it names, is."""
    pinned = {_norm(d.dist): d for d in pin.distributions.values() if d.platform_plugin}
    want = ", ".join(f"{d.dist} {d.version} ({name}: {d.status})" for name, d in pin.distributions.items()
                     if d.platform_plugin) or "none"
    found = platform_plugins()
    if not found:
        return [Check("platform plugins", want, "none installed", None)]
    checks = []
    for p in found:
        d = pinned.get(_norm(p.dist or ""))
        here = f"{p.entry_point} ({p.dist} {p.version})"
        ok = d is not None and (p.version or "").split("+")[0] == d.version
        checks.append(Check("platform plugin", f"{d.dist} {d.version}" if d else want, here, ok))
        if ok and d.source_digest and p.package is not None:
            digest, nfiles = source_digest(p.package)
            checks.append(Check("platform plugin source digest", f"{d.source_digest} ({d.source_files} files)",
                                f"{digest} ({nfiles} files)", digest == d.source_digest))
    return checks


def mismatch_lines(checks: list[Check]) -> list[str]:
    return [f"mismatch: {c.what}: expected {c.expected}, found {c.found}" for c in checks if c.ok is False]

