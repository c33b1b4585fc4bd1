"""`vllm-tour lab check`: a lab filled with the reference is clean against upstream; a planted bug fails,
naming the step and field."""

import ast
import re
import shlex
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from vllm_tour.cli import app
from vllm_tour.lab.catalog import LABS
from vllm_tour.lab.check import check_lab, unwritten
from vllm_tour.lab.new import new_lab
from vllm_tour.paths import REPO_ROOT


def fill_from_reference(lab_file: Path, reference: Path) -> str:
    """The skeleton with every unwritten body replaced by the reference's body of the same name."""
    ref = ast.parse(reference.read_text())
    bodies = {}
    for node in ref.body:
        if isinstance(node, ast.FunctionDef):
            bodies[node.name] = node.body
        elif isinstance(node, ast.ClassDef):
            bodies.update({f"{node.name}.{f.name}": f.body for f in node.body if isinstance(f, ast.FunctionDef)})
    todo = set(unwritten(lab_file))
    tree = ast.parse(lab_file.read_text())
    for node in tree.body:
        owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for fn in (node.body if isinstance(node, ast.ClassDef) else [node]):
            if isinstance(fn, ast.FunctionDef) and owner + fn.name in todo:
                fn.body = bodies[owner + fn.name]
                todo.discard(owner + fn.name)
    assert not todo, f"the reference has no body for {todo}"
    return ast.unparse(tree)


def make_lab(tmp_path: Path, component: str, bug: tuple[str, str] | None = None, scenario: str | None = None) -> Path:
    """A lab for `component`, filled from the reference; `bug` = (pattern, replacement), applied exactly once;
    `scenario`: check only that one (lab.toml edited as a learner may)."""
    d = tmp_path / component
    new_lab(component, d)
    if scenario:
        toml = d / "lab.toml"
        toml.write_text(re.sub(r"(?m)^scenarios = .*$", f'scenarios = ["{scenario}"]', toml.read_text()))
    file = d / f"{component}.py"
    text = fill_from_reference(file, REPO_ROOT / LABS[component].reference)
    if bug:
        text, n = re.subn(bug[0], bug[1], text)
        assert n == 1, f"planted bug {bug[0]!r} matched {n} times"
    file.write_text(text)
    assert not unwritten(file)
    return d


def check(d: Path, upstream_run) -> tuple[int, str]:
    """lab check in-process, each scenario's upstream run shared with the session (one engine start each)."""
    import tomllib

    for name in tomllib.loads((d / "lab.toml").read_text())["scenarios"]:
        upstream_run(name)
    console = Console(record=True, width=200)
    code = check_lab(d, console)
    return code, console.export_text()


@pytest.mark.parametrize("component", list(LABS))
def test_lab_filled_with_the_reference_is_clean(tmp_path, upstream_run, component):
    code, out = check(make_lab(tmp_path, component), upstream_run)
    assert code == 0, out
    for scenario in LABS[component].scenarios:
        assert f"lab {component} · {scenario}: clean" in out


PLANTED = {
    # free blocks taken from the back of the queue instead of its front
    "block_pool": ((r"self\._q\.popitem\(last=False\)", "self._q.popitem(last=True)"),
                   "cmp_evict: DIVERGED at step 1, field kv.block_tables[x]: upstream [1, 2, 3]"),
    # a finished request's blocks freed head first: its head, not its tail, is evicted first
    "kv_cache_manager": ((r"free_blocks\(list\(reversed\(blocks\)\)\)", "free_blocks(list(blocks))"),
                         "cmp_evict: DIVERGED at step 4, field kv.block_tables[z]"),
    # one token more than the request needs (or than the budget leaves)
    "scheduler": ((r"return min\(num_wanted, token_budget\)", "return min(num_wanted + 1, token_budget)"),
                  "cmp_chunked: DIVERGED at step 1, field scheduler.scheduled[short].num_scheduled_tokens: "
                  "upstream 8, yours 9"),
    # softmax scale 1/d instead of 1/sqrt(d)
    "paged_attention": ((r"scale = 1\.0 / math\.sqrt\(head_dim\)", "scale = 1.0 / head_dim"),
                        "cmp_single: DIVERGED at step 1, tensor attn_out.layers.0"),
}


@pytest.mark.parametrize("component", list(PLANTED))
def test_planted_bug_fails_naming_step_and_field(tmp_path, upstream_run, component):
    bug, expected = PLANTED[component]
    code, out = check(make_lab(tmp_path, component, bug, scenario=expected.split(":")[0]), upstream_run)
    assert code == 1, out
    assert f"lab {component} · {expected}" in out
    assert "explain: state at step" in out or "tensor" in expected  # both sides' queues, budget, block tables


def test_scheduler_that_never_preempts_fails_at_the_first_preemption(tmp_path, upstream_run):
    never_preempt = (r"victim = self\.pick_victim\(\)\n\s+out\.preempted\.append\(.*\)\n\s+if victim is request:\n",
                     "if True:\n")
    code, out = check(make_lab(tmp_path, "scheduler", never_preempt), upstream_run)
    steps = upstream_run("cmp_preempt").steps
    first_preemption = min(s for s, st in steps.items() if st["scheduler"]["preempted"])
    assert code == 1
    assert "lab scheduler · cmp_chunked: clean" in out  # nothing to preempt there
    assert f"lab scheduler · cmp_preempt: DIVERGED at step {first_preemption}, field scheduler." in out
    assert f"explain: state at step {first_preemption}" in out


def test_cli_lab_check_and_the_readmes_compare_command(tmp_path, upstream_run):
    d = make_lab(tmp_path, "kv_cache_manager", PLANTED["kv_cache_manager"][0], scenario="cmp_evict")
    upstream_run("cmp_evict")
    r = CliRunner().invoke(app, ["lab", "check", str(d)], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    assert "first divergence: step 4 · kv.block_tables[z]" in r.output
    assert "lab kv_cache_manager · cmp_evict: DIVERGED at step 4, field kv.block_tables[z]" in r.output

    # the README's command for the first scenario, as a learner would paste it
    command = re.search(r"^\.venv/bin/vllm-tour (compare .*?--explain)$", (d / "README.md").read_text(), re.M | re.S)
    r = CliRunner().invoke(app, shlex.split(command.group(1).replace("\\\n", " ")), env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    assert "first divergence: step 4 · kv.block_tables[z]" in r.output and "explain: state at step 4" in r.output
