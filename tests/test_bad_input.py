"""Bad input is one error line and exit 2, found before any engine starts, with nothing left written.

"Before any engine starts" is checked directly: the command runs in a process that reports at exit
whether `vllm` was ever imported (an engine cannot start without it). Unwritable paths are made so
that they refuse root too (the tests run as root, for whom permission bits mean nothing): a path
under a regular file, and one under /proc.
"""

import os
import subprocess
import sys

import pytest

from vllm_tour.paths import REPO_ROOT, SCENARIOS_DIR

VLLM_IMPORTED = "<vllm was imported>"
_MAIN = ("import atexit, sys\n"
         f"atexit.register(lambda: 'vllm' in sys.modules and print({VLLM_IMPORTED!r}, file=sys.stderr))\n"
         "from vllm_tour.cli import main\nmain()\n")


def vllm_tour(*args, env=None):
    return subprocess.run([sys.executable, "-c", _MAIN, *map(str, args)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200", **(env or {})})


def assert_one_line_exit_2(r, message):
    assert VLLM_IMPORTED not in r.stderr, "vLLM was imported: the error came after the engine was set up"
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def scenario(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text('name = "s"\n' + text)
    return p


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("not a directory\n")
    return f


REQUEST = '[[requests]]\nid = "r0"\n'
BAD_SCENARIOS = [
    (REQUEST + "token_ids = [1, 512]\n", "token id 512 is outside model tiny-qwen3's vocabulary (ids 0..511)"),
    (REQUEST + "token_ids = [1, -3]\n", "token id -3 is negative"),
    (REQUEST + "token_ids = []\n", "request r0: the prompt is empty"),
    (REQUEST + 'prompt = ""\n', "request r0: the prompt is empty"),
    (REQUEST + 'prompt = "hi"\ntemperature = -0.5\n', "temperature must be >= 0"),
    ('[engine]\ndtype = "float8"\n' + REQUEST + 'prompt = "hi"\n', "engine.dtype: Input should be"),
    ('[engine]\nmax_model_len = 8\n' + REQUEST + 'prompt = "one two three four five six seven eight"\n',
     "engine.max_model_len 8 allows at most 7"),
    ('[engine]\nmax_model_len = 4096\n' + REQUEST + 'prompt = "hi"\n', "max_position_embeddings 2048"),
]


@pytest.mark.parametrize("text, message", BAD_SCENARIOS, ids=[m.split(":")[0][:40] for _, m in BAD_SCENARIOS])
def test_a_bad_scenario_fails_before_the_engine(tmp_path, text, message):
    out = tmp_path / "run"
    assert_one_line_exit_2(vllm_tour("trace", "--scenario", scenario(tmp_path, text), "--out", out), message)
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (("-r", ""), "request r0: the prompt is empty"),
        (("-r", "hi", "--temperature", "-1"), "temperature must be >= 0"),
        (("-r", "hi", "--capture-steps", "x-y"), "--capture-steps 'x-y': give step numbers and ranges"),
        (("-r", "hi", "--capture-steps", "3-1"), "--capture-steps '3-1'"),
    ],
)
def test_bad_trace_flags_fail_before_the_engine(tmp_path, flags, message):
    out = tmp_path / "run"
    assert_one_line_exit_2(vllm_tour("trace", *flags, "--out", out), message)
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (("-r", "hi", "--max-model-len", "0"), "max_model_len must be at least 2 (one prompt token and one generated), got 0"),
        (("-r", "hi", "--max-num-seqs", "0"), "max_num_seqs must be at least 1, got 0"),
        # upstream would clamp it to the room left (1024 - 2 prompt tokens) and say nothing
        (("-r", "hi", "--max-tokens", "100000000"), "request r0: max_tokens 100000000 does not fit: the prompt is 2 tokens "
                                                    "and engine.max_model_len 1024 leaves room for at most 1022"),
        (("-r", "hi", "--max-model-len", "64", "--max-tokens", "63"), "leaves room for at most 62 generated tokens"),
    ],
    ids=["max_model_len_0", "max_num_seqs_0", "max_tokens_huge", "max_tokens_one_past"],
)
def test_numbers_out_of_range_fail_before_the_engine(tmp_path, flags, message):
    out = tmp_path / "run"
    assert_one_line_exit_2(vllm_tour("trace", *flags, "--out", out), message)
    assert not out.exists()


def test_a_requests_file_that_is_not_a_utf8_text_file(tmp_path):
    latin1 = tmp_path / "prompts.txt"
    latin1.write_bytes("hello\ncafé au lait\n".encode("latin-1"))
    out = tmp_path / "run"
    assert_one_line_exit_2(vllm_tour("trace", "--requests-file", latin1, "--out", out),
                           f"requests file {latin1} is not UTF-8 text (byte 0xe9 on line 2)")
    assert_one_line_exit_2(vllm_tour("trace", "--requests-file", tmp_path, "--out", out),
                           f"requests file {tmp_path} is a directory")
    assert_one_line_exit_2(vllm_tour("trace", "--requests-file", tmp_path / "nope.txt", "--out", out),
                           f"requests file {tmp_path / 'nope.txt'} does not exist")
    assert not out.exists()


def test_trace_out_that_cannot_be_written(tmp_path, a_file):
    assert_one_line_exit_2(vllm_tour("trace", "-r", "hi", "--out", a_file / "run"), f"{a_file} is not a directory")
    assert_one_line_exit_2(vllm_tour("trace", "-r", "hi", "--out", a_file), f"{a_file} is not a directory")
    assert_one_line_exit_2(vllm_tour("trace", "-r", "hi", "--out", "/proc/vllm-tour-run"), "cannot write in /proc")
    assert a_file.read_text() == "not a directory\n"


def test_trace_out_refuses_a_run_dir_it_would_overwrite(tmp_path):
    old = tmp_path / "old-run"
    old.mkdir()
    (old / "meta.json").write_text("{}")
    (old / "records.1.jsonl").write_text("{}\n")
    assert_one_line_exit_2(vllm_tour("trace", "-r", "hi", "--out", old), "give --force")
    assert sorted(p.name for p in old.iterdir()) == ["meta.json", "records.1.jsonl"]
    assert "--force" in vllm_tour("trace", "--help").stdout


def test_an_unwritable_model_cache(tmp_path, a_file):
    cache = {"VLLM_TOUR_CACHE": str(a_file / "cache")}  # a fresh cache: the tiny model would be generated there
    assert_one_line_exit_2(vllm_tour("trace", "-r", "hi", "--out", tmp_path / "run", env=cache), "model cache (VLLM_TOUR_CACHE)")
    assert_one_line_exit_2(vllm_tour("models", "make", env=cache), "model cache (VLLM_TOUR_CACHE)")
    assert_one_line_exit_2(vllm_tour("pin", "v0.21.0", "--fetch", env=cache), "source cache (VLLM_TOUR_CACHE)")
    assert not (tmp_path / "run").exists()


def test_export_site_and_compare_outputs_that_cannot_be_written(tmp_path, a_file):
    assert_one_line_exit_2(vllm_tour("export", "single", "--out", a_file / "t.json"), f"{a_file} is not a directory")
    assert_one_line_exit_2(vllm_tour("export", "single", "--out", "/proc/t.json"), "cannot write in /proc")
    assert_one_line_exit_2(vllm_tour("export", "single", "--out", tmp_path), "is a directory (give a file name)")
    assert_one_line_exit_2(vllm_tour("site", "--out", a_file / "site"), f"{a_file} is not a directory")
    assert_one_line_exit_2(vllm_tour("compare", "reimpl.paged_attn", "--scenario", SCENARIOS_DIR / "cmp_single.toml",
                                     "--json", a_file / "r.json"), f"{a_file} is not a directory")


def test_probes_on_an_unknown_pin_names_the_pin():
    assert_one_line_exit_2(vllm_tour("probes", "--pin", "v9.9.9"), "no pin 'v9.9.9'")


def test_repro_out_refuses_a_run_dir_it_would_overwrite(tmp_path):
    old = tmp_path / "old-run"
    old.mkdir()
    (old / "meta.json").write_text('{"status": "failed"}')
    assert_one_line_exit_2(vllm_tour("repro", SCENARIOS_DIR / "repro_preemption.toml", "--out", old), "give --force")
    assert (old / "meta.json").read_text() == '{"status": "failed"}'


def test_source_works_with_an_unwritable_cache(a_file):
    """The symbol index is only a cache: a lookup that needs it (an unknown symbol: the nearest names)
    still answers in one line when the cache cannot be written."""
    r = vllm_tour("source", "vllm.v1.core.block_pool.BlockPool.free_blockz", env={"VLLM_TOUR_CACHE": str(a_file / "cache")})
    assert_one_line_exit_2(r, "did you mean: vllm.v1.core.block_pool.BlockPool.free_blocks")
