"""`vllm-tour lab new COMPONENT DIR`: write a skeleton, lab.toml and README.md into DIR."""

from __future__ import annotations

import os
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.lab.labdir import LAB_TOML, lab_file_name, lab_for, lab_toml_text, read_lab
from vllm_tour.lab.readme import readme_text
from vllm_tour.lab.skeleton import skeleton_source


def new_lab(component: str, directory: Path, force: bool = False) -> list[Path]:
    """Write the lab; returns the files written. Refuses to overwrite anything without `force`."""
    lab = lab_for(component)
    directory = Path(directory).resolve()
    if directory.exists() and not directory.is_dir():
        raise TourError(f"{directory} is a file, not a folder")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        if (directory / LAB_TOML).is_file():
            raise TourError(f"{directory} already holds a lab ({read_lab(directory).lab.component}): check it with "
                            f"`vllm-tour lab check {directory}`, or pass --force to overwrite it with a fresh skeleton")
        raise TourError(f"{directory} is not empty and holds no lab: choose a new or empty folder "
                        "(or pass --force to write the lab's files into it)")
    # everything is generated before anything is written: a failure leaves DIR as it was
    files = {
        lab_file_name(lab): skeleton_source(lab),
        LAB_TOML: lab_toml_text(lab),
        "README.md": readme_text(lab, directory),
    }
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = directory / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half
        written.append(path)
    return written
