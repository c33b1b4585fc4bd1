"""`vllm-tour probes --platform maca --source PATH`: a platform plugin's sources against a pin and its probes.

What a run on the plugin's hardware would depend on, checked without the hardware:
- the plugin declares the platform entry point the pin names;
- every upstream attribute it patches when its entry points run exists on the pin (a
  patch of a module or class the pin lacks fails; an attribute the pin lacks on a class
  it has is an addition, listed: a renamed upstream method would look the same);
- it registers a class for each attention backend the pin's probes are declared for,
  and the probes declared for the platform target what those classes use (the method
  `get_builder_cls` / `get_impl_cls` returns), with the declared leading parameters;
- the upstream probes of the pin resolve in the pin's sources;
- which probe targets the plugin replaces (at run time the probe wraps the plugin's
  function and the run records it: probes/base.py `settle`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.platforms.package_names import PackageNames
from vllm_tour.platforms.plugin_source import PLATFORM_GROUP, Backend, EntryPoint, Patch, PluginSource, opened
from vllm_tour.probes import maca
from vllm_tour.probes.base import Probe
from vllm_tour.upstream.pins import load_pin, source_digest

PLATFORMS = {maca.PLATFORM: maca}  # platform plugin -> its probe declarations module


@dataclass
class Finding:
    check: str  # sources | entry point | patch | backend | probe
    subject: str
    ok: bool | None  # None: reported, not a failure
    detail: str


@dataclass
class PluginReport:
    platform: str
    pin: str
    source: str
    digest: str
    files: int
    entry_points: list[EntryPoint]
    backends: list[Backend]
    patches: list[Patch]
    findings: list[Finding] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # probe targets the plugin patches

    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.ok is False]

    def to_json(self) -> dict:
        d = asdict(self)
        d["entry_points"] = [{"group": e.group, "name": e.name, "value": e.value} for e in self.entry_points]
        d["ok"] = not self.failures()
        return d


def check_plugin(platform: str, pin: str, source: Path, tree=None) -> PluginReport:
    """Read the plugin at `source` (tarball or directory) and check it against `pin` (TourError: bad input)."""
    if platform not in PLATFORMS:
        raise TourError(f"unknown platform {platform!r} (platform plugins with probe declarations: {', '.join(PLATFORMS)})")
    pinned = load_pin(pin)
    dist = pinned.distributions.get(platform)
    if dist is None:
        raise TourError(f"pin {pin} names no {platform} distribution (pins/{pin}.toml [distributions.{platform}])")
    if tree is None:
        from vllm_tour.notes.pinned import tree_for_pin

        tree = tree_for_pin(pin)
    with opened(source) as root:
        src = PluginSource(root)
        package = PLATFORMS[platform].PACKAGE
        if package not in src.packages:
            raise TourError(f"plugin sources {source}: its entry points name {', '.join(src.packages)}, not {package}")
        digest, files = source_digest(root / package)
        report = PluginReport(platform, pin, str(source), digest, files, src.entry_points, src.backends(), src.patches())
        f = report.findings
        same = digest == dist.source_digest
        f.append(Finding("sources", f"{dist.dist} {dist.tag or dist.version}", None,
                         f"the pinned sources (commit {dist.commit})" if same
                         else f"not the pinned sources: digest {digest} ({files} files), the pin says {dist.source_digest}"))
        f += _entry_point(report, dist.platform_plugin)
        upstream = PackageNames(tree.root)
        f += _patches(report, upstream)
        f += _probes(report, src, pinned.profile.attention_backends, upstream, PackageNames(root / package))
    return report


def _entry_point(report: PluginReport, want: str | None) -> list[Finding]:
    have = [str(e) for e in report.entry_points if e.group == PLATFORM_GROUP]
    ok = want in have if want else bool(have)
    return [Finding("entry point", want or PLATFORM_GROUP, ok,
                    f"{PLATFORM_GROUP}: {', '.join(have) or 'none'}" + ("" if ok else f" (the pin names {want})"))]


def _patches(report: PluginReport, upstream: PackageNames) -> list[Finding]:
    out = []
    for p in report.patches:
        why = upstream.missing(p.target)
        owner_why = upstream.missing(p.target.rpartition(".")[0]) if why else None
        by = f"by {', '.join(e.split(' = ')[0] for e in p.applied_by)}" if p.applied_by else "imported by no entry point"
        if why is None:
            ok, detail = True, f"on pin {report.pin}"
        elif owner_why is None:
            ok, detail = None, f"adds it: not on pin {report.pin} ({why}); a renamed upstream attribute would look the same"
        else:
            ok, detail = False, f"not on pin {report.pin}: {owner_why}"
        if not p.applied_by:
            ok = None  # never runs: listed, not held against the plugin
        out.append(Finding("patch", p.target, ok, f"{p.where} {by}: {detail}"))
    return out


def _probes(report: PluginReport, src: PluginSource, backends: list[str], upstream: PackageNames,
            plugin: PackageNames) -> list[Finding]:
    from vllm_tour.probes.install import probes_for
    from vllm_tour.probes.static import hook_problems
    registered = {b.name: b for b in src.backends()}
    patched = {p.target: p for p in report.patches if p.applied_by}
    owners = PLATFORMS[report.platform].OWNER_METHOD
    out: list[Finding] = []
    seen: set[str] = set()
    for backend in backends:
        b = registered.get(backend)
        out.append(Finding("backend", backend, b is not None,
                           f"{b.class_path} ({b.where})" if b else "the plugin registers no class for it: upstream's would run"))
        try:
            chosen = probes_for(report.pin, backend, platform=report.platform)
        except TourError as e:
            out.append(Finding("probe", backend, False, str(e)))
            continue
        for p in chosen:
            if p.target in seen:
                continue
            seen.add(p.target)
            out.append(_probe_finding(p, plugin if p.platform == report.platform else upstream))
            if p.platform == report.platform and b is not None and p.name in owners:
                got = src.class_method_return(b.class_path, owners[p.name])
                want = p.target.rpartition(".")[0]
                out.append(Finding("probe", f"{p.name} ({backend})", got == want,
                                   f"{b.class_path.rpartition('.')[2]}.{owners[p.name]}() returns {got or 'no single name'}"
                                   + ("" if got == want else f", the probe targets {want}")))
            if p.platform == report.platform:
                out += [Finding("probe", p.name, False, msg) for msg in hook_problems(p)]
            if p.target in patched:
                report.replaced.append(p.target)
                out.append(Finding("replaced", p.target, None,
                                   f"the plugin replaces it ({patched[p.target].where}): probe {p.name} wraps the plugin's "
                                   "function and the run records that (probe_target record)"))
    return out


def _probe_finding(p: Probe, package: PackageNames) -> Finding:
    try:
        names = package.params(p.target)
    except TourError as e:
        return Finding("probe", p.target, False, f"probe {p.name}: target not found: {e}")
    ok = tuple(names[: len(p.params)]) == p.params
    return Finding("probe", p.target, ok, f"probe {p.name}: ({', '.join(names)})" if ok else
                   f"probe {p.name}: parameters ({', '.join(names)}), expected ({', '.join(p.params)}, ...)")


def render(report: PluginReport, console) -> None:
    """The report as rich tables: entry points, backends, findings; then one line per failed check."""
    from rich.markup import escape
    from rich.table import Table

    console.print(f"[bold]{report.platform}[/] plugin sources {escape(report.source)} against pin {report.pin}: "
                  f"{report.files} files, {report.digest}", highlight=False)
    eps = Table(title="entry points", title_justify="left")
    for col in ("group", "name", "value", "imports"):
        eps.add_column(col, overflow="fold")
    applied = {}
    for p in report.patches:
        for e in p.applied_by:
            applied[e] = applied.get(e, 0) + 1
    for e in report.entry_points:
        eps.add_row(e.group, e.name, e.value, f"{applied.get(str(e), 0)} patches")
    console.print(eps)
    backends = Table(title="attention backends registered under upstream's names", title_justify="left")
    for col in ("backend", "class", "where"):
        backends.add_column(col, overflow="fold")
    for b in report.backends:
        backends.add_row(b.name, b.class_path, b.where)
    console.print(backends)
    table = Table(title="checks", title_justify="left")
    for col in ("check", "subject", "detail", ""):
        table.add_column(col, overflow="fold")
    marks = {True: "[green]ok[/]", False: "[red]FAILED[/]", None: "[dim]–[/]"}
    for f in report.findings:
        table.add_row(f.check, escape(f.subject), escape(f.detail), marks[f.ok])
    console.print(table)
    applied_n = sum(1 for p in report.patches if p.applied_by)
    console.print(f"{len(report.patches)} patches of upstream vLLM ({applied_n} applied by an entry point), "
                  f"{len(report.backends)} backends registered; probe targets the plugin replaces: "
                  f"{', '.join(report.replaced) or 'none'}", highlight=False)
    for f in report.failures():
        console.print(f"[red]FAILED[/] {f.check} {escape(f.subject)}: {escape(f.detail)}", highlight=False)
