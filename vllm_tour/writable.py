"""Output paths are checked before any work starts.

A bad `--out` should be one error line at once, not a traceback after a
ten-second engine start. Permission bits alone do not tell (root ignores
them; a read-only mount or /proc refuses root too), so the check creates and
removes a temporary file where the output will go.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .errors import TourError


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
