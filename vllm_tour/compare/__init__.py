"""`vllm-tour compare`: run upstream (with probes) and a reimpl module on one scenario, then diff.

harness.py   runs both sides (upstream runs cached per scenario), builds a CompareResult
diffs.py     tokens, per-step decisions (scheduler, KV, runner, attention) and tensors
tokens.py    token rules: exact (fp32), vLLM's top-k rule (bf16); no torch (the GPU runner imports it)
report.py    rich report; the JSON report is CompareResult.to_json()
command.py   the CLI command (exit 0 clean, 1 diverged, 2 could not run)
pytest_plugin.py  fixtures for "my component vs upstream" tests
"""
