"""Where things live: the checkout (pins, annotations, traces) and the user cache."""

import os
from pathlib import Path

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


def cache_dir() -> Path:
    """XDG cache for generated models and fetched upstream sources."""
    override = os.environ.get("VLLM_TOUR_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-tour"
