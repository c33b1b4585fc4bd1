"""A lab folder: the learner's file, `lab.toml` (what `lab check` runs) and README.md."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.lab.catalog import LABS, Lab
from vllm_tour.paths import SCENARIOS_DIR

LAB_TOML = "lab.toml"


@dataclass
class LabDir:
    path: Path
    lab: Lab  # the catalog entry of the recorded component
    file: Path  # the learner's file
    module: str
    scenarios: list[Path]

    @property
    def component(self) -> str:
        return self.lab.component

    @property
    def impl(self) -> dict[str, str]:
        """What compare swaps in: {component: "FILE.py:Name"} (`--impl COMPONENT=FILE.py:Name`)."""
        return {self.lab.component: f"{self.file}:{self.lab.entry}"}


def lab_for(component: str) -> Lab:
    if component not in LABS:
        raise TourError(f"unknown lab component {component!r} (known: {', '.join(LABS)})")
    return LABS[component]


def lab_file_name(lab: Lab) -> str:
    return f"{lab.component}.py"


def scenario_path(name: str) -> Path:
    return SCENARIOS_DIR / f"{name}.toml"


def lab_toml_text(lab: Lab) -> str:
    scenarios = ", ".join(f'"{s}"' for s in lab.scenarios)
    return (f"# A vllm-tour lab, written by `vllm-tour lab new {lab.component}`; `vllm-tour lab check` reads it.\n"
            f'component = "{lab.component}"\n'
            f'file = "{lab_file_name(lab)}"  # yours: fill in what raises NotImplementedError\n'
            f'module = "{lab.module}"  # the compare module, with your file swapped in for {lab.component}\n'
            f"scenarios = [{scenarios}]  # traces/scenarios/<name>.toml\n"
            f'reference = "{lab.reference}"  # what the skeleton was generated from\n')


def read_lab(directory: Path) -> LabDir:
    """The lab in `directory`; TourError (one line) if there is none or it is damaged."""
    directory = Path(directory).resolve()
    toml = directory / LAB_TOML
    if not toml.is_file():
        raise TourError(f"{directory} is not a lab (no {LAB_TOML}): "
                        f"make one with `vllm-tour lab new COMPONENT {directory}`")
    try:
        data = tomllib.loads(toml.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TourError(f"malformed {toml}: {e}") from None
    missing = [k for k in ("component", "file", "module", "scenarios") if k not in data]
    if missing:
        raise TourError(f"{toml} lacks {', '.join(missing)}")
    lab = lab_for(data["component"])
    file = directory / data["file"]
    if not file.is_file():
        raise TourError(f"the lab's file {file} is missing (lab.toml names it)")
    scenarios = [scenario_path(s) for s in data["scenarios"]]
    absent = [s.stem for s in scenarios if not s.is_file()]
    if absent or not scenarios:
        raise TourError(f"{toml}: no scenario {', '.join(absent) or '(empty list)'} in {SCENARIOS_DIR}")
    return LabDir(directory, lab, file, data["module"], scenarios)
