"""`vllm-tour cache`: what the user cache holds, with sizes, and clearing one cache; compare's runs live there."""

from vllm_tour.paths import RUNS_DIR, compare_cache


def test_compare_runs_are_cached_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TOUR_CACHE", str(tmp_path))
    assert compare_cache() == tmp_path / "compare-runs"
    assert RUNS_DIR not in compare_cache().parents


def test_cache_lists_sizes_and_clears_one(tmp_path, cli):
    env = {"VLLM_TOUR_CACHE": str(tmp_path)}
    (tmp_path / "compare-runs" / "r-1").mkdir(parents=True)
    (tmp_path / "compare-runs" / "r-1" / "records.1.jsonl").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "w").write_bytes(b"y" * 2**20)
    out = cli("cache", env=env)
    assert out.returncode == 0, out.stderr
    assert "compare-runs" in out.stdout and "3.0 MiB" in out.stdout and "total" in out.stdout and "4.0 MiB" in out.stdout
    out = cli("cache", "--clear", "compare-runs", env=env)
    assert out.returncode == 0 and "cleared compare-runs: 3.0 MiB freed" in out.stdout
    assert not (tmp_path / "compare-runs").exists() and (tmp_path / "models" / "w").exists()
    out = cli("cache", "--clear", "everything", env=env)
    assert out.returncode == 2 and "no cache 'everything' (caches: models, sources, index, compare-runs)" in out.stdout + out.stderr
