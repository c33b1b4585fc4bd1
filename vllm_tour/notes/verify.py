"""`vllm-tour annotations verify`: prove notes' claims on live upstream runs.

annotations/proofs/<pin>.toml maps a note id to the scenario that shows the
behaviour, the check (a function in source/proofs/) that tests it on that
scenario's trace, and the claim in both languages, as true of that pin (the
file sits apart from the notes, which `annotations` loads from annotations/*.toml):

    [pool-free-order]
    scenario = "cmp_evict"                       # traces/scenarios/<name>.toml
    check = "hashless_before_fresh_before_cached"
    claim.en = "..."
    claim.zh = "..."
    only_on = ["v0.32.0"]                        # optional: the releases whose recorded run proves it, when
                                                 # fewer than the note is shown on (no environment of the others)

Each scenario runs once on the installed upstream engine (cached by scenario
content, shared with `compare` and the tests); every claim on it is then checked.

`scenario = "serve"` is no scenario file but a `vllm-tour serve` run a client drove (claims on the serving
path: the front end's records against the engine's). verify cannot drive a server: it checks those claims on
the serve run kept under traces/golden/proofs/<pin>/serve (recorded by tests/test_serve.py), or on a run you
served yourself (`--run RUN`); tests/test_serve.py checks them on the run its own server leaves.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_tour.errors import TourError
from vllm_tour.notes import proofs
from vllm_tour.notes.annotations import LANGS, all_notes, load_all, read_toml
from vllm_tour.notes.proofs.requirements import requirements
from vllm_tour.paths import ANNOTATIONS_DIR, GOLDEN_DIR, SCENARIOS_DIR
from vllm_tour.upstream import pins

PROOFS_DIR = ANNOTATIONS_DIR / "proofs"
SERVE = "serve"  # the "scenario" of claims checked on a `vllm-tour serve` run, not a file in SCENARIOS_DIR
CHECKS = {name: fn for mod in proofs.MODULES for name, fn in vars(mod).items()
          if inspect.isfunction(fn) and fn.__module__ == mod.__name__ and not name.startswith("_")}


class Proof(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scenario: str
    check: str
    claim: dict[str, str] | None = None  # None: another release's file keeping the default pin's claim
    # The releases this proof holds a note to, when fewer than those the note is shown on: its scenario's run could
    # be recorded only there (no environment of the others here). None: every release the note is shown on.
    only_on: list[str] | None = None

    @field_validator("claim")
    @classmethod
    def _bilingual(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        missing = [lang for lang in LANGS if not v.get(lang, "").strip()]
        if missing:
            raise ValueError(f"missing claim language(s) {missing}")
        return v


@dataclass
class Verdict:
    note: str
    scenario: str
    check: str
    claim: str
    holds: bool
    step: int | None
    evidence: str
    requires: tuple[str, ...] = ()  # what the run must show, as the check fails without it (proofs/requirements.py)


def load_proofs(path: Path, claims: bool = True) -> dict[str, Proof]:
    """Note id -> Proof; TourError for a malformed file, an unknown note, scenario or check, and (claims) an
    entry without its claim."""
    data = read_toml(path)
    notes = {n.id for n in all_notes(load_all())}
    out = {}
    for note_id, entry in data.items():
        where = f"{path.name} [{note_id}]"
        if not isinstance(entry, dict):
            raise TourError(f"{where}: expected a table with scenario, check and claim")
        try:
            proof = Proof.model_validate(entry)
        except ValidationError as e:
            err = e.errors()[0]
            raise TourError(f"{where}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        if note_id not in notes:
            raise TourError(f"{where}: no note with id '{note_id}' in {ANNOTATIONS_DIR}")
        if proof.scenario != SERVE and not (SCENARIOS_DIR / f"{proof.scenario}.toml").is_file():
            raise TourError(f"{where}: no scenario '{proof.scenario}' in {SCENARIOS_DIR}")
        if proof.check not in CHECKS:
            raise TourError(f"{where}: no check '{proof.check}' in {proofs.__name__}")
        if claims and proof.claim is None:
            raise TourError(f"{where}: claim: Field required")
        if proof.only_on is not None and path.parent == PROOFS_DIR and path.stem not in proof.only_on:
            raise TourError(f"{where}: only_on {proof.only_on} leaves out {path.stem}, whose own file this is")
        out[note_id] = proof
    return out


def proofs_for_pin(pin: str) -> dict[str, Proof]:
    """Note id -> Proof on `pin`: the default CPU pin's file as it is; for another release, the default pin's
    claims on the notes that say the same there (no text of the release's own, not hidden there), then the
    release's own file (annotations/proofs/<pin>.toml, if any): the claims of its own text, and other scenarios
    where the default's does not make the case happen on it (an entry without a claim keeps the default's)."""
    default = pins.default_pin("cpu")
    own_path = PROOFS_DIR / f"{pin}.toml"
    own = load_proofs(own_path, claims=pin == default) if own_path.is_file() else {}
    if pin == default:
        return own
    base = load_proofs(PROOFS_DIR / f"{default}.toml")
    notes = {n.id: n for n in all_notes(load_all())}
    # Serve runs are recorded on the default pin only (the server probes are its own): no serve claim elsewhere.
    table = {i: p for i, p in base.items()
             if pin not in notes[i].variant and pin not in notes[i].not_on and p.scenario != SERVE
             and (p.only_on is None or pin in p.only_on)}
    for note_id, proof in own.items():
        if proof.claim is None:
            if note_id not in base:
                raise TourError(f"{own_path.name} [{note_id}]: no claim, and {default} has none to keep")
            proof = proof.model_copy(update={"claim": base[note_id].claim})
        table[note_id] = proof
    return table


def check_pin_installed(pin: str) -> None:
    """Proofs run the live engine: the pin must be the installed vLLM."""
    if pin not in pins.available_pins():
        raise TourError(f"unknown pin {pin} (known: {', '.join(pins.available_pins())})")
    inst = pins.installed_vllm()
    here = f"{inst.dist} {inst.version}" if inst else "no vLLM"
    if inst is None or f"v{inst.version}" != pin:
        raise TourError(f"pin {pin} is not installed here ({here}): its proofs run only where that vLLM runs "
                        f"(v0.21.0: the CUDA engine on the GPU machine)")


def recorded_run(pin: str, scenario: str) -> Path:
    """Where `--record` keeps the run a scenario's claims were verified on (what the site links to)."""
    return GOLDEN_DIR / "proofs" / pin / scenario


def _by_scenario(selected: dict[str, Proof]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for note_id, proof in selected.items():
        out.setdefault(proof.scenario, []).append(note_id)
    return out


def recorded_verdicts(pin: str, selected: dict[str, Proof]) -> list[Verdict]:
    """The claims checked on the runs `--record` kept for `pin`; a scenario with no kept run is one error line."""
    from vllm_tour.trace.reader import load_run

    verdicts = []
    for name, note_ids in _by_scenario(selected).items():
        path = recorded_run(pin, name)
        if not (path / "meta.json").is_file():
            raise TourError(f"no run of {name} recorded on {pin} ({path}): record it where {pin} runs "
                            f"(`annotations verify --pin {pin} --record`, or the GPU runner's trace step for v0.21.0)")
        verdicts += check_claims(load_run(path), name, note_ids, selected)
    return verdicts


def check_claims(run, name: str, note_ids: list[str], selected: dict[str, Proof]) -> list[Verdict]:
    verdicts = []
    for note_id in note_ids:
        proof = selected[note_id]
        needs = requirements(CHECKS[proof.check])
        try:
            verdicts.append(Verdict(note_id, name, proof.check, proof.claim["en"], True, None, CHECKS[proof.check](run), needs))
        except proofs.ClaimFailed as e:
            verdicts.append(Verdict(note_id, name, proof.check, proof.claim["en"], False, e.step, e.evidence, needs))
    return verdicts


def serve_verdicts(run_path: str | Path, selected: dict[str, Proof]) -> list[Verdict]:
    """The selected serve claims checked on one `vllm-tour serve` run (a directory, or a name `show` takes)."""
    from vllm_tour.trace.reader import load_run

    note_ids = [n for n, p in selected.items() if p.scenario == SERVE]
    if not note_ids:
        raise TourError("--run checks claims proven on a serve run, and none of the selected notes has one")
    run = load_run(run_path)
    if (run.meta.engine_args or {}).get("mode") != "serve":
        raise TourError(f"{run.path} is not a `vllm-tour serve` run: --run checks the serving-path claims on one")
    return check_claims(run, SERVE, note_ids, selected)


def run_proofs(selected: dict[str, Proof], progress: Console, record_pin: str | None = None) -> list[Verdict]:
    """Each scenario's upstream run (cached), its claims checked; with record_pin, a run whose claims all hold is
    kept, small and without tensors, as recorded_run(record_pin, scenario). Serve claims are not here (verify
    checks them on the kept serve run)."""
    from vllm_tour.compare.upstream import upstream_run_for
    from vllm_tour.engine.golden import write_golden
    from vllm_tour.scenario import load_scenario
    from vllm_tour.trace.reader import load_run

    verdicts = []
    for name, note_ids in _by_scenario(selected).items():
        progress.print(f"[dim]upstream run of {name} ({len(note_ids)} claim{'s' * (len(note_ids) != 1)})…[/]")
        run = load_run(upstream_run_for(load_scenario(SCENARIOS_DIR / f"{name}.toml")))
        these = check_claims(run, name, note_ids, selected)
        if record_pin and all(v.holds for v in these):
            write_golden(run, recorded_run(record_pin, name), drop_capture_records=True)
        verdicts += these
    return verdicts


@contextmanager
def _stdout_to_stderr():
    """vLLM logs to stdout, and so do the engine processes it starts (they inherit fd 1): while engines run,
    fd 1 is stderr, so that stdout stays the JSON report."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def verify(console: Console, pin: str | None, note_ids: list[str], as_json: bool, proofs_path: Path | None,
           record: bool = False, recorded: bool = False, run: str | Path | None = None) -> int:
    """Exit code: 0 every claim holds, 1 some claim fails. record: keep each verified run (recorded_run);
    recorded: check the claims on the runs kept for the pin instead of running its engine (a pin that cannot run
    here: v0.21.0's CUDA engine); run: check the serve claims on that `vllm-tour serve` run, nothing else."""
    pin = pin or pins.active_pin_tag()
    if not recorded and run is None:
        check_pin_installed(pin)
    table = load_proofs(proofs_path) if proofs_path else proofs_for_pin(pin)
    path = proofs_path or PROOFS_DIR / f"{pin}.toml"
    unknown = [n for n in note_ids if n not in table]
    if unknown:
        raise TourError(f"no proof for note(s) {', '.join(unknown)} in {path}")
    selected = {n: table[n] for n in (note_ids or table)}
    record_pin = pin if record else None
    served = {n: p for n, p in selected.items() if p.scenario == SERVE}
    live = {n: p for n, p in selected.items() if p.scenario != SERVE}
    if run is not None:
        verdicts = serve_verdicts(run, selected)
    elif recorded:
        verdicts = recorded_verdicts(pin, selected)
    else:
        progress = Console(stderr=True) if as_json else console
        if served:
            progress.print(f"[dim]{len(served)} serve claims: on the serve run kept in {recorded_run(pin, SERVE)} "
                           f"(verify drives no server; --run RUN checks a serve run of yours)[/]")
        with _stdout_to_stderr() if as_json else nullcontext():
            verdicts = run_proofs(live, progress, record_pin) if live else []
        verdicts += recorded_verdicts(pin, served) if served else []
    failed = [v for v in verdicts if not v.holds]
    if as_json:
        print(json.dumps({"proven": len(verdicts) - len(failed), "failed": len(failed),
                          "claims": [asdict(v) for v in verdicts]}, indent=2, ensure_ascii=False))
        return 1 if failed else 0
    runs = (f"the serve run {run}" if run is not None else f"the runs recorded on {pin}" if recorded
            else f"live {pin} runs")
    out = Table(title=f"annotations verify — {len(verdicts) - len(failed)} of {len(verdicts)} claims hold on {runs}")
    for col in ("note", "scenario", "verdict", "evidence (seen) · required"):
        out.add_column(col, overflow="fold")
    for v in verdicts:
        verdict = "[green]holds[/]" if v.holds else f"[red]FAILS[/] at step {v.step}" if v.step else "[red]FAILS[/]"
        needs = "; ".join(n.removeprefix("the run never shows ") for n in v.requires)
        out.add_row(v.note, v.scenario, verdict, escape(v.evidence) + f"\n[dim]required: {escape(needs)}[/]")
    console.print(out)
    for v in failed:
        where = f"step {v.step}" if v.step is not None else "the whole run"
        console.print(f"[red]claim fails[/] {v.note} on {v.scenario}, {where}: {escape(v.evidence)}\n"
                      f"  claim: {escape(v.claim)}", soft_wrap=True)
    return 1 if failed else 0
