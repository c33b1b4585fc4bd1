"""Where things live: the checkout (pins, annotations, traces) and the user cache."""

import importlib.metadata
import os
import shutil
import tempfile
import tomllib
from pathlib import Path

from vllm_tour.errors import TourError

REPO_ROOT = Path(__file__).resolve().parent.parent
PINS_DIR = REPO_ROOT / "pins"
ANNOTATIONS_DIR = REPO_ROOT / "annotations"
TRACES_DIR = REPO_ROOT / "traces"
SCENARIOS_DIR = TRACES_DIR / "scenarios"
GOLDEN_DIR = TRACES_DIR / "golden"
# Where trace, repro and compare runs go (and the "latest" pointer): VLLM_TOUR_RUNS moves them out of the
# checkout, e.g. for tests that must not change a user's runs or which run is "latest".
RUNS_DIR = Path(os.environ.get("VLLM_TOUR_RUNS") or TRACES_DIR / "runs")
DATA_DIR = Path(__file__).resolve().parent / "data"


def _tour_version() -> str:
    # pyproject.toml is the one source; a checkout carried to the GPU machine is not installed there
    try:
        return importlib.metadata.version("vllm-tour")
    except importlib.metadata.PackageNotFoundError:
        return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


TOUR_VERSION = _tour_version()


def cache_dir() -> Path:
    """XDG cache for generated models and fetched upstream sources."""
    override = os.environ.get("VLLM_TOUR_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-tour"


# What lives in the user cache, by folder: each is rebuilt on demand when it is cleared.
CACHES = {
    "models": "the tiny models and the dummy-weight Qwen3-0.6B (generated on first use)",
    "sources": "pinned vLLM sources fetched for `source --pin` and `annotations check`",
    "index": "indexes of pinned sources (qualified name -> file and lines)",
    "compare-runs": "upstream runs cached by scenario content for `compare`, the labs and the notes' proofs",
}


def compare_cache() -> Path:
    return cache_dir() / "compare-runs"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def cache_sizes() -> dict[str, int]:
    """Bytes held by each cache folder (0: absent)."""
    root = cache_dir()
    return {name: _size(root / name) if (root / name).is_dir() else 0 for name in CACHES}


def clear_cache(name: str) -> int:
    """Delete one cache folder; returns the bytes freed."""
    if name not in CACHES:
        raise TourError(f"no cache {name!r} (caches: {', '.join(CACHES)})")
    path = cache_dir() / name
    if not path.is_dir():
        return 0
    freed = _size(path)
    shutil.rmtree(path)
    return freed


# Output paths are checked before any work starts.
# A bad `--out` should be one error line at once, not a traceback after a
# ten-second engine start. Permission bits alone do not tell (root ignores
# them; a read-only mount or /proc refuses root too), so the check creates and
# removes a temporary file where the output will go.

def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _try_write(directory: Path, what: str, path: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise TourError(f"{what} {path}: cannot write in {directory} ({e.strerror or e})") from None


def _check(directory: Path, what: str, path: Path) -> None:
    base = _nearest_existing(directory)
    if not base.is_dir():
        raise TourError(f"{what} {path}: {base} is not a directory")
    _try_write(base, what, path)


def check_dir(path: Path, what: str) -> None:
    """`path` is, or can be created as, a directory we can write files in."""
    _check(Path(path), what, path)


def check_file(path: Path, what: str) -> None:
    """`path` can be written as a file (written atomically: a temporary file beside it, then a rename)."""
    path = Path(path)
    if path.is_dir():
        raise TourError(f"{what} {path} is a directory (give a file name)")
    _check(path.parent, what, path)
