"""CompareResult: what one comparison found (tokens, per-step divergences, tensors), and its JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_tour.compare import flow, tolerance
from vllm_tour.compare.diffs import Divergence
from vllm_tour.compare.tolerance import TensorStat
from vllm_tour.trace.logprobs import TOP_K


@dataclass
class CompareResult:
    module: str
    scenario: str
    scenario_path: str
    upstream_run: str
    steps_upstream: int
    steps_reimpl: int
    tokens: dict[str, dict]  # req_id -> {"upstream": [...], "reimpl": [...], "forced": bool}
    divergences: list[Divergence]
    tensors: list[TensorStat]
    notes: list[str] = field(default_factory=list)
    explain: dict | None = None
    duration_s: float = 0.0
    tolerance: tolerance.Tolerance = tolerance.FP32
    upstream_backend: str | None = None
    upstream_isa: str | None = None  # CPU attention kernel ISA upstream ran (vec, amx, ...); None on CUDA
    dtype: str = "float32"  # what upstream ran in (and so the reimpl): decides the token rule and tolerance
    impl: dict[str, str] = field(default_factory=dict)  # component -> the learner's object that replaced the reference
    not_compared: list[dict] = field(default_factory=list)  # [{what, why}]: what this comparison does not judge
    tensors_judged: bool = True  # False: the module is judged on decisions and tokens only

    @property
    def first(self) -> Divergence | None:
        """The headline: the earliest step with a difference, and in it the earliest in the data flow (the
        decisions before the model, then layer by layer the first tensor out of tolerance, then the sampled
        tokens: flow.py); the outputs' tokens only when every step agrees."""
        items = self.ordered()
        return items[0] if items else None

    def ordered(self) -> list[Divergence]:
        """Every divergence, and the first step of each out-of-tolerance tensor, in data-flow order."""
        return flow.ordered(self.divergences, self.bad_tensors)

    @property
    def bad_tensors(self) -> list[TensorStat]:
        return [t for t in self.tensors if not t.ok]

    @property
    def clean(self) -> bool:
        return not self.divergences and not self.bad_tensors

    @property
    def exit_code(self) -> int:
        return 0 if self.clean else 1

    @property
    def tokens_rule(self) -> str:
        if self.dtype == "float32":
            return "exact"
        return (f"vLLM's check_logprobs_close: at the first differing greedy token each side's token is in the other's "
                f"top-{TOP_K}; not compared after it (the reimpl runs on upstream's tokens: teacher forcing)")

    def to_json(self) -> dict:
        first = self.first
        worst = max(self.tensors, key=lambda t: t.max_abs, default=None)
        return {
            "module": self.module,
            "scenario": self.scenario,
            "scenario_path": self.scenario_path,
            "status": "clean" if self.clean else "diverged",
            "exit_code": self.exit_code,
            "upstream_run": self.upstream_run,
            "impl": self.impl,
            "steps": {"upstream": self.steps_upstream, "reimpl": self.steps_reimpl},
            "first_divergence": first.to_json() if first else None,
            "first_tensor_out_of_tolerance": self.bad_tensors[0].to_json() if self.bad_tensors else None,
            "dtype": self.dtype,
            "tokens_rule": self.tokens_rule,
            "tolerance": {"atol": self.tolerance.atol, "rtol": self.tolerance.rtol, "name": self.tolerance.name,
                          "reason": self.tolerance.reason, "upstream_attention_backend": self.upstream_backend,
                          "upstream_cpu_attention_isa": self.upstream_isa,
                          "rule": self.tolerance.rule,
                          "exact": (["tokens"] if self.dtype == "float32" else [])
                          + ["scheduler decisions", "block tables and pool events", "runner inputs and slot mapping"]},
            "tensors_judged": self.tensors_judged,
            "tensor_summary": {"judged": self.tensors_judged, "compared": len(self.tensors),
                               "out_of_tolerance": len(self.bad_tensors), "max_abs": worst.max_abs if worst else None},
            "not_compared": self.not_compared,
            "divergences": [d.to_json() for d in self.divergences[:200]],
            "num_divergences": len(self.divergences),
            "tensors": [t.to_json() for t in self.tensors],
            "tokens": self.tokens,
            "notes": self.notes,
            "explain": self.explain,
            "duration_s": round(self.duration_s, 3),
        }
