"""The `vllm-tour` command line. Thin: each command parses, calls one function, prints.

Errors meant for users are `TourError`: one line on stderr, exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import TourError

app = typer.Typer(
    help="See what upstream vLLM does, step by step, at a pinned version.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="The embedded tiny checkpoints (generated, byte-identical everywhere).", no_args_is_help=True)
app.add_typer(models_app, name="models")

console = Console()


@app.command()
def pin(
    tag: Optional[str] = typer.Argument(None, help="Pin tag, e.g. v0.32.0 (default: v<installed version>)."),
    commit: Optional[str] = typer.Option(None, help="Commit to record when the wheel's _version.py records none."),
    fetch: bool = typer.Option(False, "--fetch", help="Instead: download TAG's wheel and keep its Python sources in the cache (for `source`/`annotations check` on a pin that is not installed)."),
    out: Optional[Path] = typer.Option(None, help="Write here instead of pins/<tag>.toml."),
):
    """Write pins/<TAG>.toml from the installed vLLM: version, commit, distribution, torch, source digest."""
    from . import pins

    if fetch:
        if not tag:
            raise TourError("--fetch needs a TAG")
        path = pins.fetch_sources(tag)
        console.print(f"sources of {tag} in {path}")
        return
    p = pins.pin_from_installed(tag, commit)
    path = pins.write_pin(p, out)
    console.print(f"wrote {path}: {p.distributions[p.platform].dist} {p.version}, {p.source_files} files, {p.source_digest}")


@app.command()
def doctor(
    pin: Optional[str] = typer.Option(None, "--pin", help="Pin tag to check against (default: the pin of the installed vLLM)."),
    vllm_root: Optional[Path] = typer.Option(None, help="Check this vLLM source tree instead of the installed one.", hidden=True),
):
    """Check this environment against a pin: vLLM, source digest, torch, platform, Python, GPU. Exit 2 on mismatch."""
    from . import doctor as doc
    from . import pins

    tag = pin or pins.active_pin_tag()
    p = pins.load_pin(tag)
    checks = doc.run_checks(p, vllm_root)
    table = Table(title=f"vllm-tour doctor — pin {tag}")
    for col in ("check", "pin", "here", ""):
        table.add_column(col, overflow="fold")
    marks = {True: "[green]ok[/]", False: "[red]MISMATCH[/]", None: ""}
    for c in checks:
        table.add_row(c.what, c.expected, c.found, marks[c.ok])
    console.print(table)
    bad = doc.mismatch_lines(checks)
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        raise typer.Exit(2)


@models_app.command("make")
def models_make(
    name: str = typer.Argument("tiny-qwen3", help="tiny-qwen3 or tiny-qwen3-moe."),
    force: bool = typer.Option(False, help="Regenerate even if present."),
):
    """Generate a tiny checkpoint (HF layout) in the user cache and print its path and digest."""
    from . import models

    path = models.make_tiny_model(name, force=force)
    console.print(f"{name}: {path}  sha256 {models.model_digest(path)}")


def main() -> None:
    try:
        app()
    except TourError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
