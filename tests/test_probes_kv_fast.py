"""The KV record's fast path (only the block lists that grew since the previous record are read, when the
scheduler holds the same requests and none was freed) gives the record the full read of every list gives,
step by step on a real engine: preemptions, prefix-cache hits, tables growing, user ids used again
(tests/_kv_fast_worker.py). So do the scheduler record's columns when the same requests run in the same
order as at the previous step (ids, kinds and prompt lengths reused; prefill rechecked only where it was)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_kv_fast_worker.py")


def test_kv_fast_path_equals_the_full_read():
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["mismatches"] == [], seen
    # the run went through what the fast path must get right, and took it on most steps
    assert seen["preempted"] > 0 and seen["hits"] > 0 and seen["grown"] > 20, seen
    assert seen["steps"] > 50 and seen["fast"] > seen["steps"] // 2, seen
    assert seen["sched_mismatches"] == [], seen
    assert seen["sched_fast"] > seen["sched_steps"] // 3 and seen["sched_prefill_fast"] > 0, seen
