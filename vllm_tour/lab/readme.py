"""The README.md of a lab folder: what to write, the exact commands, how to read their output."""

from __future__ import annotations

from pathlib import Path

from vllm_tour.lab.catalog import Lab
from vllm_tour.lab.labdir import lab_file_name, scenario_path
from vllm_tour.paths import REPO_ROOT
from vllm_tour.scenario import load_scenario


def readme_text(lab: Lab, directory: Path) -> str:
    file = directory / lab_file_name(lab)
    scenarios = "\n".join(f"- `{name}`: {load_scenario(scenario_path(name)).description}" for name in lab.scenarios)
    compares = "\n".join(
        f".venv/bin/vllm-tour compare {lab.module} --impl {lab.component}={file}:{lab.entry} \\\n"
        f"    --scenario {scenario_path(name).relative_to(REPO_ROOT)} --explain"
        for name in lab.scenarios)
    return f"""# Lab: {lab.component}

Write your own `{lab.entry}` in `{lab_file_name(lab)}` and check it, step by step, against
upstream vLLM running here. The file was generated from the reference `{lab.reference}`
by `vllm-tour lab new {lab.component}`: the same classes, methods and signatures (the
reference engine calls them), with every body you have to write raising
`NotImplementedError("... not written yet")`. The helpers and dataclasses around them are
the reference's and can be used as they are.

## Do it

1. Read the docstrings in `{lab_file_name(lab)}`. Each says what upstream does and names the
   annotated notes to read (`Note pool-get-new: ...`); `vllm-tour source QUALNAME` prints
   the pinned upstream code with those notes in place.
2. Fill in every body that raises `NotImplementedError`. Keep the names and signatures; add
   helpers as you like. Do not import from `vllm`.
3. From the vllm-tour checkout ({REPO_ROOT}), run

   ```
   .venv/bin/vllm-tour lab check {directory}
   ```

   Exit 0: your `{lab.entry}` makes the same decisions as upstream on every scenario below.
   Exit 1: it diverged (the first divergence is printed). Exit 2: it could not run (for
   example, bodies still unwritten: the message names them).

## What `lab check` runs

The mini engine of `{lab.module}` with your file swapped in for `{lab.component}` (everything
else stays the reference), against upstream's cached run of each scenario:

{scenarios}

which is the same as running, one scenario at a time:

```
{compares}
```

## Reading the output

- **first divergence: step N · FIELD**: the first engine step at which your side decided
  differently, and what: `scheduler.*` (which requests ran, how many tokens each, who was
  preempted or finished), `kv.*` (block tables, blocks allocated / freed / evicted, prefix
  hits, free block count), `runner.*` (the flattened batch: positions, slot mapping). The
  `upstream:` and `reimpl:` lines under it are the two values (`reimpl` is yours).
- **explain: state at step N**: both sides' state at that step, one row each (queues before
  and after, token budget, tokens scheduled per request, preempted, finished, free blocks,
  block tables, prefix hits, freed, evicted); red rows differ. Below it the block tables of
  the step before, and your engine's own state after `schedule()` (budget left, why admission
  stopped, the head of the free queue, running and waiting requests as
  `id(computed/total tokens)`).
- **tokens**: generated tokens per request, exact in fp32. A wrong decision usually shows up
  in the steps long before it changes a token.
- **tensors** (attention and KV blocks, for `reimpl.paged_attn`): the largest difference per
  captured tensor against the stated tolerance.
- A Python error in your code is reported as a divergence `reimpl.exception` at the step it
  was raised in, with the file and line.
"""
