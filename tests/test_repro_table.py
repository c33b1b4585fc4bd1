"""`repro --all`'s verdict table at 80 columns and piped: every name, verdict and evidence whole (issue 29 item 5)."""

import io
import re

from rich.console import Console

from vllm_tour.repro.library import library, verdict_table
from vllm_tour.scenario import load_scenario

EVIDENCE = ("preempted: r2 at step 38 (allocate_slots for r0 (1 tokens) failed with 0 free blocks; r2 is the "
            "lowest-priority running request)")


def _render(width: int) -> str:
    rows = [(load_scenario(p), {"v0.32.0": "REPRODUCED", "v0.21.0": "not run here; declared NOT REPRODUCED"}, EVIDENCE)
            for p in library()]
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(verdict_table(rows, ["v0.32.0", "v0.21.0"], "v0.32.0", width))
    return out.getvalue(), rows


def _flat(text: str) -> str:
    # a folded line continues on the next one inside its cell: join the cells' lines back together
    cells = [re.sub(r"^[│|┃]\s?|\s*[│|┃]$", "", line) for line in text.splitlines()]
    return " ".join(c.strip() for c in cells)


def test_nothing_is_cut_at_80_columns():
    text, rows = _render(80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = _flat(text)
    for sc, _, _ in rows:
        assert sc.name in flat
    assert flat.count("v0.32.0: REPRODUCED") == len(rows)
    assert " ".join(EVIDENCE.split()) in " ".join(flat.split())


def test_wide_terminals_keep_the_columns():
    text, rows = _render(200)
    assert "evidence" in text and "…" not in text
