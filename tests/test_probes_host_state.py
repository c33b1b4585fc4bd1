"""On CUDA the runner and attention probes read each step's positions, sequence lengths, logits
indices, slot mapping and block-table rows from the runner's host state (copying them from the GPU
would sync the device every step). The CPU runner holds the same host state *and* the tensors
themselves, so here both are computed for every step of a real engine run (tests/_host_state_worker.py)
and must agree, prefill and decode steps alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_host_state_worker.py")


def test_host_state_values_equal_the_runner_tensors():
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["mismatches"] == []
    assert seen["prepare"] > 0 and seen["build"] == seen["prepare"]
    assert 0 < seen["prefill_steps"] < seen["prepare"]  # both kinds of step were checked
    # the worker runs the CPU overhead bench: the traced side's warm-up round is reported apart, and no round
    # leaves the probes installed
    assert proc.stdout.count("first traced round") == 3  # one per trace level
    assert "ratio steps=" in proc.stdout
    assert seen["probes_left_installed"] is False
