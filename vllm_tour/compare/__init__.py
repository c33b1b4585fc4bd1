"""`vllm-tour compare`: run upstream (with probes) and a reimpl module on one scenario, then diff.

modules.py       the compare modules: components each runs, sections and tensors each is judged on
components.py    the swappable components' interfaces; load_impl for `--impl COMPONENT=FILE.py[:Name]`
harness.py       compare(): both sides, the diffs, a CompareResult (result.py)
upstream.py      the upstream run (cached per scenario), read through trace.reader
reimpl_side.py   the reference engine built from the module's (or the learner's) components
diffs.py         tokens, per-step decisions (scheduler, KV, runner, attention) and tensor statistics
tensor_diff.py   captured tensors, upstream vs reimpl; explain.py  --explain
tokens.py        token rules: exact (fp32), vLLM's top-k rule (bf16); no torch (the GPU runner imports it)
report.py        rich report; the JSON report is CompareResult.to_json()
command.py       the CLI command (exit 0 clean, 1 diverged, 2 could not run)
pytest_plugin.py fixtures for "my component vs upstream" tests
"""
