"""The reimpl engine writes the same trace records as upstream's probes: they validate against trace/schema.py."""

import pytest
from pydantic import TypeAdapter

from vllm_tour.compare.reimpl_side import engine_components, run_reimpl
from vllm_tour.compare.upstream import load_upstream
from vllm_tour.trace.schema import Record

RECORD = TypeAdapter(Record)


def _unknown_keys(raw, validated) -> list[str]:
    """Keys the reimpl wrote that the schema does not have (pydantic would drop them silently)."""
    if isinstance(raw, dict) and isinstance(validated, dict):
        return [k for k in raw if k not in validated] + [
            f"{k}.{sub}" for k in raw if k in validated for sub in _unknown_keys(raw[k], validated[k])]
    if isinstance(raw, list) and isinstance(validated, list):
        return [sub for a, b in zip(raw, validated) for sub in _unknown_keys(a, b)]
    return []


@pytest.mark.parametrize("name", ["cmp_preempt", "cmp_shared_prefix"])  # preemptions and frees; prefix hits
def test_reimpl_records_validate_against_the_trace_schema(upstream_run, name):
    run = upstream_run(name)
    _, results, _ = run_reimpl(run.scenario, load_upstream(run.run_dir), engine_components("reimpl.paged_attn"))
    kinds = set()
    for res in results:
        for rec in res.records:
            validated = RECORD.validate_python(rec).model_dump(mode="json")  # a missing or mistyped field raises
            assert _unknown_keys(rec, validated) == [], (res.out.step, rec["kind"])
            kinds.add(rec["kind"])
    assert kinds == {"scheduler", "kv", "runner"}


def test_reimpl_moe_records_validate_against_the_trace_schema(upstream_run):
    """reimpl.ep's MoE records (one per layer and simulated rank) are schema.MoERecords, like the probe's."""
    run = upstream_run("cmp_moe_single")
    _, results, _ = run_reimpl(run.scenario, load_upstream(run.run_dir), engine_components("reimpl.ep"))
    moe = [r for res in results for r in res.records if r["kind"] == "moe"]
    for rec in moe:
        validated = RECORD.validate_python(rec).model_dump(mode="json")
        assert _unknown_keys(rec, validated) == [], rec["step"]
    assert {(r["layer"], r["proc"]["rank"]) for r in moe if r["step"] == 1} == {(0, 0), (0, 1), (1, 0), (1, 1)}
