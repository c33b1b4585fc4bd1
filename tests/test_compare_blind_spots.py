"""What compare used to let through: a tensor one side lacks, a reordered batch, wrong logits rows, a crash
reported a step early; and what a comparison does not judge, listed with the reason."""

import json
import shutil

from typer.testing import CliRunner

from reimpl import engine, input_batch, kv_cache_manager
from vllm_tour.cli import app
from vllm_tour.compare import harness
from vllm_tour.compare.pytest_plugin import format_first


def test_a_capture_the_reimpl_skips_is_out_of_tolerance(compare_upstream, upstream_run, monkeypatch):
    execute = engine.Engine._execute

    def skip_layer_1(self, *args, **kwargs):
        runner, sampled, tensors = execute(self, *args, **kwargs)
        tensors.pop("attn_out.layers.1")
        return runner, sampled, tensors

    monkeypatch.setattr(engine.Engine, "_execute", skip_layer_1)
    r = compare_upstream("reimpl.paged_attn", "cmp_single")
    assert r.exit_code == 1
    assert not r.divergences  # decisions and tokens are untouched: only the missing tensor fails
    bad = r.bad_tensors
    assert {t.name for t in bad} == {"attn_out.layers.1"}
    steps = upstream_run("cmp_single").steps
    assert [t.step for t in bad] == [s for s, st in sorted(steps.items())
                                     if any(c["name"] == "attn_out.layers.1" for c in st["captures"])]
    assert bad[0].step == 1 and "the reimpl did not produce attn_out.layers.1 at step 1" in bad[0].note
    assert "tensor attn_out.layers.1 at step 1" in format_first(r)


def _edited_copy(run_dir, tmp_path, edit):
    """A copy of an upstream run whose records (one list per records file) went through `edit`."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    for records in run.glob("records*.jsonl"):
        lines = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
        records.write_text("".join(json.dumps(rec) + "\n" for rec in edit(lines)))
    return run


def test_a_capture_upstream_lacks_is_out_of_tolerance(upstream_run, tmp_path):
    """The other side: upstream's run lost one capture record (the reimpl produced that tensor)."""
    run = _edited_copy(upstream_run("cmp_single").run_dir, tmp_path, lambda records: [
        rec for rec in records if not (rec["kind"] == "capture" and rec["step"] == 2 and rec["name"] == "kv_blocks.layers.0")])
    r = harness.compare("reimpl.paged_attn", "traces/scenarios/cmp_single.toml", upstream_run=run)
    assert r.exit_code == 1
    [bad] = r.bad_tensors
    assert (bad.name, bad.step) == ("kv_blocks.layers.0", 2)
    assert "the upstream did not produce kv_blocks.layers.0 at step 2" in bad.note


def test_reversed_batch_rows_diverge_on_row_order(compare_upstream, upstream_run, monkeypatch):
    """Same requests, same per-request inputs, rows laid out in reverse: the row order is named."""
    update = input_batch.InputBatch.update
    monkeypatch.setattr(input_batch.InputBatch, "update", lambda self, scheduled: update(self, scheduled)[::-1])
    r = compare_upstream("reimpl.chunked_prefill", "cmp_concurrent")
    assert r.exit_code == 1
    steps = upstream_run("cmp_concurrent").steps
    first_batch = min(s for s, st in steps.items() if len((st.get("runner") or {}).get("req_ids", [])) > 1)
    assert (r.first.step, r.first.field) == (first_batch, "runner.req_ids")
    assert r.first.reimpl == r.first.upstream[::-1]
    assert "batch row order differs" in r.first.message
    assert not any(d.field.startswith("runner.requests") for d in r.divergences)  # per request all agrees


def test_logits_rows_off_by_one_diverge(compare_upstream, monkeypatch):
    prepare = engine.Engine.prepare_inputs

    def logits_one_early(self, batch, drafts):
        input_ids, positions, meta, logits_idx = prepare(self, batch, drafts)
        return input_ids, positions, meta, [i - 1 for i in logits_idx]

    monkeypatch.setattr(engine.Engine, "prepare_inputs", logits_one_early)
    r = compare_upstream("reimpl.chunked_prefill", "cmp_single")
    assert r.exit_code == 1
    assert (r.first.step, r.first.field) == (1, "runner.logits_indices")
    assert r.first.reimpl == [i - 1 for i in r.first.upstream]


def test_upstream_without_logits_indices_says_not_recorded(upstream_run, tmp_path):
    """A run whose runner records carry no logits indices is compared on the rest and says so."""
    run = _edited_copy(upstream_run("cmp_single").run_dir, tmp_path, lambda records: [
        {**rec, "logits_indices": []} if rec["kind"] == "runner" else rec for rec in records])
    r = harness.compare("reimpl.chunked_prefill", "traces/scenarios/cmp_single.toml", upstream_run=run)
    assert r.exit_code == 0, format_first(r)
    [item] = [x for x in r.not_compared if "logits_indices" in x["what"]]
    assert item["why"].startswith("not recorded in this run")


def test_crash_in_allocate_slots_names_its_step_and_decision(compare_upstream, upstream_run, monkeypatch):
    allocate = kv_cache_manager.KVCacheManager.allocate_slots

    def fail_at_third_output(self, request, *args, **kwargs):
        if request.num_output_tokens == 3:
            raise RuntimeError("planted")
        return allocate(self, request, *args, **kwargs)

    monkeypatch.setattr(kv_cache_manager.KVCacheManager, "allocate_slots", fail_at_third_output)
    r = compare_upstream("reimpl.chunked_prefill", "cmp_single")
    steps = upstream_run("cmp_single").steps
    k = next(s for s, st in sorted(steps.items())
             if any(x["req_id"] == "r0" and x["num_output_tokens"] == 3 for x in st["scheduler"]["scheduled"]))
    assert r.exit_code == 1
    assert (r.first.kind, r.first.step, r.first.field) == ("crash", k, "reimpl.exception")
    assert f"raised in step {k} during allocate_slots for r0" in r.first.message
    assert "RuntimeError: planted" in r.first.reimpl
    assert "chunked_prefill.py" in r.first.message  # the scheduler line that asked, not the engine's phase tracking
    assert len([d for d in r.divergences if d.kind != "crash"]) == 0  # steps before k agree
    assert any(f"step {k} after the reimpl raised" in x["what"] for x in r.not_compared)


def test_chunked_prefill_report_says_tensors_not_judged(upstream_run, tmp_path):
    upstream_run("cmp_single")
    out = tmp_path / "report.json"
    cli = CliRunner()
    args = ["--scenario", "traces/scenarios/cmp_single.toml", "--json", str(out)]
    r = cli.invoke(app, ["compare", "reimpl.chunked_prefill", *args], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "tensors not judged: reimpl.chunked_prefill" in r.output
    assert "not compared:" in r.output
    [scenario] = json.loads(out.read_text())["scenarios"]
    assert scenario["tensors_judged"] is False and scenario["tensor_summary"]["judged"] is False
    assert any(x["what"].startswith("tensors") for x in scenario["not_compared"])

    r = cli.invoke(app, ["compare", "reimpl.paged_attn", *args], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "tensors not judged" not in r.output
    [scenario] = json.loads(out.read_text())["scenarios"]
    assert scenario["tensors_judged"] is True
    assert not any(x["what"].startswith("tensors") for x in scenario["not_compared"])
    assert any("stale" in x["why"] for x in scenario["not_compared"])  # the KV slots past each sequence end


def test_sampled_request_listed_as_not_compared(compare_upstream, tmp_path):
    """A request at temperature > 0: its tokens are upstream's (forced), and the report says they are not compared."""
    scenario = tmp_path / "cmp_sampled.toml"
    scenario.write_text("""name = "cmp_sampled"
[engine]
num_blocks = 16
max_num_batched_tokens = 256
max_num_seqs = 4
max_model_len = 256

[[requests]]
id = "greedy"
token_ids = [17, 42, 5, 99, 314, 27, 18, 28, 1, 77]
max_tokens = 6
ignore_eos = true

[[requests]]
id = "hot"
token_ids = [120, 44, 300, 491, 271, 437, 385, 80]
max_tokens = 6
temperature = 0.8
seed = 7
ignore_eos = true
""")
    r = compare_upstream("reimpl.chunked_prefill", scenario)
    assert r.exit_code == 0, format_first(r)
    assert r.tokens["hot"]["forced"] and not r.tokens["greedy"]["forced"]
    items = [x for x in r.not_compared if "hot" in x["what"]]
    assert [x["what"] for x in items] == ["sampled tokens of hot (temperature 0.8)"]
    assert "forced" in items[0]["why"]
    assert not any("greedy" in x["what"] for x in r.not_compared)
