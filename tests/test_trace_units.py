"""Small pieces of the trace path that need no engine: env allow-list, id mapping, reader edge cases."""

import json
import shutil

import pytest

from vllm_tour.errors import TourError
from vllm_tour.paths import GOLDEN_DIR
from vllm_tour.trace.reader import load_run
from vllm_tour.engine.run import env_allow_list
from vllm_tour.trace.writer import allocate_run_dir, parse_steps, user_req_id


def test_env_allow_list_keeps_engine_knobs_and_drops_secrets(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("VLLM_API_KEY", "sk-secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("VLLM_S3_PASSWORD", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    env = env_allow_list()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and env["OMP_NUM_THREADS"] == "2"
    assert not {"VLLM_API_KEY", "HF_TOKEN", "VLLM_S3_PASSWORD", "AWS_SECRET_ACCESS_KEY"} & env.keys()


def test_golden_meta_holds_no_secrets():
    from vllm_tour.repro.library import REPROS_DIR

    metas = [*GOLDEN_DIR.rglob("meta.json"), *REPROS_DIR.rglob("meta.json")]  # goldens, proof runs, CUDA repro runs
    assert len(metas) > 20
    for meta in metas:
        text = meta.read_text()
        assert "sk-" not in text and "hf_" not in text, meta


def test_user_request_ids_drop_upstreams_suffix():
    assert user_req_id("r0-1a2b3c4d") == "r0"
    assert user_req_id("my-req-deadbeef-0123abcd") == "my-req-deadbeef"
    assert user_req_id("plain") == "plain"


def test_parse_steps():
    assert parse_steps("1-3,7") == {1, 2, 3, 7} and parse_steps("") is None


def test_a_garbled_line_in_the_middle_is_skipped_with_a_warning_naming_file_and_line(tmp_path):
    """One bad line (a disk or copy error) loses that record, not the run: the other steps load and the
    warning names file:line. (Block tables written as deltas: test_trace_compact.py.)"""
    run = shutil.copytree(GOLDEN_DIR / "preemption", tmp_path / "preemption")
    f = next(run.glob("records.*.jsonl"))
    lines = f.read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    kv = [i for i, k in enumerate(kinds) if k == "kv"][2]  # a KV record in the middle
    sched = kinds.index("scheduler", kv + 1)
    lost_kv, lost_sched = json.loads(lines[kv])["step"], json.loads(lines[sched])["step"]
    lines[kv], lines[sched] = lines[kv][:20], "\x00garbled{" + lines[sched][5:]
    f.write_text("\n".join(lines) + "\n")
    loaded = load_run(run)
    whole = load_run(GOLDEN_DIR / "preemption")
    assert [s.index for s in loaded.steps] == [s.index for s in whole.steps]
    assert loaded.step(lost_kv).kv is None and loaded.step(lost_sched).scheduler is None
    assert all(s.scheduler is not None for s in loaded.steps if s.index != lost_sched)
    skipped = [w for w in loaded.warnings if "skipped a line that is not a trace record" in w]
    assert [w.split(": skipped")[0] for w in skipped] == [f"{f}:{kv + 1}", f"{f}:{sched + 1}"]
    # everything before the lost record is exactly what the whole file gives
    assert [s.kv for s in loaded.steps if s.index < lost_kv] == [s.kv for s in whole.steps if s.index < lost_kv]


def test_missing_or_broken_meta_is_an_error(tmp_path):
    with pytest.raises(TourError, match="not a vllm-tour run directory"):
        load_run(tmp_path)
    (tmp_path / "meta.json").write_text("{")
    with pytest.raises(TourError, match="cannot read"):
        load_run(tmp_path)


def test_newer_schema_is_refused(tmp_path):
    run = shutil.copytree(GOLDEN_DIR / "single", tmp_path / "single")
    meta = json.loads((run / "meta.json").read_text())
    meta["schema_version"] = 99
    (run / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TourError, match="trace schema 99"):
        load_run(run)


def test_summarized_int_lists_digest_the_same_values_on_both_sides():
    """The probe summarizes the runner's int32/int64 buffers; compare re-digests the reimpl's Python ints."""
    import numpy as np

    from vllm_tour.probes.runner import EDGE, FULL_LIMIT, int_list
    from vllm_tour.trace.schema import IntList, int_digest

    values = [(i * 7919) % 100_003 for i in range(2048)]
    for dtype in (np.int32, np.int64):
        s = IntList.model_validate(int_list(np.asarray(values, dtype=dtype)[:1000]))
        assert (s.full, s.length, s.head, s.tail) == (None, 1000, values[:EDGE], values[1000 - EDGE : 1000])
        assert s.sha256 == int_digest(values[:1000]) != int_digest(values[:999])
    small = IntList.model_validate(int_list(np.asarray(values[:FULL_LIMIT], dtype=np.int32)))
    assert small.full == values[:FULL_LIMIT] and small.sha256 is None


def test_run_dirs_allocated_in_the_same_second_for_the_same_prompt_are_distinct(tmp_path):
    """The name is <stamp>-<prompt's words>: runs started together collide on it. Each gets its own new, empty
    directory (os.mkdir either creates it or fails: the loser takes the next suffix), never another's."""
    from concurrent.futures import ThreadPoolExecutor

    name = "20261201-214500-same-prompt"
    (tmp_path / name).mkdir()  # a run from earlier in that second
    with ThreadPoolExecutor(8) as pool:
        dirs = list(pool.map(lambda _: allocate_run_dir(tmp_path, name), range(16)))
    assert len(set(dirs)) == 16 and all(d.is_dir() and not any(d.iterdir()) for d in dirs)
    assert sorted(d.name for d in dirs) == sorted(f"{name}-{n}" for n in range(2, 18))
