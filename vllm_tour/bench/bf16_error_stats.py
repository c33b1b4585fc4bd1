"""How far the bf16 reimpl's tensors are from upstream's, for the correct reimpl and small real bugs.

    PYTHONPATH=$PWD python -m vllm_tour.bench.bf16_error_stats [--module reimpl.paged_attn] [--scenario cmp_single_bf16 ...]
                                                               [--mutation correct softmax_scale ...]

For each scenario and mutation it runs `compare` (upstream from the compare cache) and prints, per
compared tensor over all steps: max |Δ|, mean |Δ|, gain = sum(Δ·ref) / sum(ref²) (the reimpl is
(1 + gain) x upstream), rel_rms = ||Δ|| / ||ref||, and the median and p99 of |Δ| in ulps of the bf16
reference element. tolerance.BF16's limits come from these numbers.

The mutations are bugs a bf16 max |Δ| of 5e-2 does not see; tests/test_compare_bf16.py uses them too.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from safetensors import safe_open

from reimpl.engine import Engine
from reimpl.qwen3 import apply_rope
from vllm_tour.compare import harness, tolerance
from vllm_tour.compare.reimpl_side import check_module, engine_components
from vllm_tour.paths import SCENARIOS_DIR

SCENARIOS = ("cmp_single_bf16", "cmp_chunked_bf16", "cmp_preempt_bf16")
NORM_WEIGHT = "model.layers.0.input_layernorm.weight"


def _with_attention(wrap):
    """An engine factory whose model's attention is wrap(model, attention)."""
    def factory(cfg, base=None):
        eng = (base or Engine)(cfg)
        eng.model.attention = wrap(eng.model, eng.model.attention)
        return eng
    return factory


def _query_scaled(factor):
    """Attention with the softmax scale times factor(model): q scaled in fp32, which paged_attention upcasts to
    anyway (the Triton kernel would take q in fp32 against a bf16 cache: not used with it)."""
    def wrap(model, attention):
        f = factor(model)
        return lambda q, *a: attention(q.float() * f, *a).to(q.dtype)
    return _with_attention(wrap)


def _query_rope_one_ahead(model, attention):
    # q arrives rotated to its position p; rotating it once more by position 1 puts it at p + 1
    cos, sin = model.cos[1:2], model.sin[1:2]
    return lambda q, *a: attention(apply_rope(q, cos, sin), *a)


def _norm_weight_scaled(factor: float):
    """The checkpoint's fp32 NORM_WEIGHT times factor, then rounded to the model dtype as upstream loads it."""
    def factory(cfg, base=None):
        eng = (base or Engine)(cfg)
        with safe_open(str(Path(cfg.model_dir) / "model.safetensors"), "pt") as f:
            eng.model.w[NORM_WEIGHT] = (f.get_tensor(NORM_WEIGHT) * factor).to(eng.model.dtype)
        return eng
    return factory


# name -> (what it is, engine factory (cfg, base factory) -> Engine); None: the reimpl as it is
MUTATIONS = {
    "correct": ("the reimpl as it is", None),
    "softmax_scale": ("softmax scale x 1.01", _query_scaled(lambda model: 1.01)),
    "sqrt_d_minus_1": ("softmax scale 1/sqrt(head_dim - 1)",
                       _query_scaled(lambda model: math.sqrt(model.head_dim / (model.head_dim - 1)))),
    "rmsnorm_weight": (f"{NORM_WEIGHT} x 1.005", _norm_weight_scaled(1.005)),
    "rope_query_off_by_one": ("RoPE of the queries at position + 1", _with_attention(_query_rope_one_ahead)),
}


def engine_factory(module: str, mutation: str):
    """The engine factory compare() takes for `module` with `mutation` applied (None: the module's own)."""
    check_module(module)  # the Triton interpreter before reimpl.triton_attn is imported, on a CPU
    components = engine_components(module)
    make = MUTATIONS[mutation][1]
    return (lambda cfg: Engine(cfg, **components)) if make is None else (lambda cfg: make(cfg, lambda c: Engine(c, **components)))


def ulp_quantiles(up: torch.Tensor, re_: torch.Tensor, qs=(0.5, 0.99)) -> list[float]:
    """Quantiles of |Δ| in ulps of each bf16 reference element (ulp of x in [2^e, 2^(e+1)) is 2^(e-7))."""
    up, re_ = up.double().flatten(), re_.double().flatten()
    _, exp = torch.frexp(up.abs().clamp_min(2.0**-126))
    ulps = (re_ - up).abs() / torch.ldexp(torch.ones_like(up), exp - 8)
    return [float(ulps.quantile(q)) for q in qs]


def measure(module: str, scenario: str, mutation: str) -> list[dict]:
    pairs: dict[str, list] = {}
    compare_tensor = tolerance.compare_tensor

    def keep(name, step, up, re_, *a, **kw):  # the (masked) tensors behind each statistic, for the ulp quantiles
        stat = compare_tensor(name, step, up, re_, *a, **kw)
        mask = kw.get("mask", a[2] if len(a) > 2 else None)
        if stat.numel:
            pairs.setdefault(name, []).append((up[mask] if mask is not None else up, re_[mask] if mask is not None else re_))
        return stat

    tolerance.compare_tensor = keep
    try:
        r = harness.compare(module, SCENARIOS_DIR / f"{scenario}.toml", engine_factory=engine_factory(module, mutation))
    finally:
        tolerance.compare_tensor = compare_tensor
    rows = []
    for s in (t for t in r.tensors if t.step is None):
        ups, res = zip(*pairs[s.name])
        p50, p99 = ulp_quantiles(torch.cat([u.flatten() for u in ups]), torch.cat([x.flatten() for x in res]))
        worst = max((t for t in r.tensors if t.name == s.name and t.step is not None), key=lambda t: abs(t.gain))
        rows.append(dict(scenario=scenario, mutation=mutation, name=s.name, max_abs=s.max_abs, mean_abs=s.mean_abs,
                         gain=s.gain, rel_rms=s.rel_rms, p50_ulp=p50, p99_ulp=p99, worst_step_gain=worst.gain,
                         failed=s.failed, decisions=len([d for d in r.divergences if d.kind != "tokens"]),
                         tokens_ok=not [d for d in r.divergences if d.kind == "tokens"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", default="reimpl.paged_attn")
    ap.add_argument("--scenario", nargs="+", default=list(SCENARIOS))
    ap.add_argument("--mutation", nargs="+", default=list(MUTATIONS), choices=list(MUTATIONS))
    args = ap.parse_args()
    print(f"limits ({tolerance.BF16.name}): {tolerance.BF16.rule}")
    cols = ("max_abs", "mean_abs", "gain", "rel_rms", "p50_ulp", "p99_ulp", "worst_step_gain")
    print(f"{'scenario':17s} {'mutation':22s} {'tensor':19s}" + "".join(f"{c:>16s}" for c in cols) + "  failed")
    for scenario in args.scenario:
        for mutation in args.mutation:
            for row in measure(args.module, scenario, mutation):
                print(f"{scenario:17s} {mutation:22s} {row['name']:19s}" + "".join(f"{row[c]:16.3e}" for c in cols)
                      + f"  {','.join(row['failed']) or '-'}", flush=True)


if __name__ == "__main__":
    main()
