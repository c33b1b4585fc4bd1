"""The components a learner can swap into the reference engine (`--impl COMPONENT=FILE.py[:Name]`).

For each component: the reference object in reimpl/, the methods the engine and the other
components call (their parameters are read from the reference with inspect.signature, so
this file cannot drift from it), the attributes they read, what upstream's counterpart
does, and the annotated notes to read (`vllm-tour source` shows them beside the code).

    pool = load_impl("block_pool", "labs/my_pool.py:BlockPool")  # TourError if it cannot work

A learner's file is imported by path. Relative imports in it resolve against `reimpl/`,
so a copy of a reference file runs as it is (`from .request import Request`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_tour.compare.modules import REFERENCE
from vllm_tour.errors import TourError


@dataclass(frozen=True)
class Component:
    name: str
    reference: str  # "module:object" in reimpl/ (modules.REFERENCE)
    methods: tuple[str, ...]  # called from outside; empty for a function (its own signature is the interface)
    attributes: tuple[str, ...]  # read from outside (found missing only when the engine runs)
    upstream: tuple[str, ...]  # qualified names of the counterparts at the pin
    doc: str
    notes: tuple[str, ...]  # annotation note ids (annotations/*.toml)

    def reference_object(self) -> object:
        module, name = self.reference.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def reference_name(self) -> str:
        return self.reference.split(":")[1]

    def signatures(self) -> dict[str, inspect.Signature]:
        """{method: the reference's signature}; for a function {its name: its signature}."""
        ref = self.reference_object()
        if not self.methods:
            return {self.reference_name: inspect.signature(ref)}
        return {m: inspect.signature(getattr(ref, m)) for m in self.methods}


COMPONENTS: dict[str, Component] = {c.name: c for c in (
    Component(
        "block_pool", REFERENCE["block_pool"],
        methods=("__init__", "get_cached_block", "cache_full_blocks", "get_new_blocks", "touch", "free_blocks",
                 "num_free_blocks", "usage", "take_events"),
        attributes=("num_blocks", "enable_caching", "null_block", "free_queue (with block_ids())",
                    "cached (hash -> {block_id: block})", "events_freed", "events_evicted"),
        upstream=("vllm.v1.core.block_pool.BlockPool", "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue"),
        doc=("Owns every physical KV block. Block 0 is the null block and never handed out. Free blocks wait in a "
             "queue in eviction order: new blocks come from its front; a freed block without a hash goes back to "
             "the front (reused soon), one with a hash to the back (kept cached longest); a prefix-cache hit pulls a "
             "free cached block out of the middle (touch). A full block gets a hash (cache_full_blocks) and stays a "
             "hit until it is handed out again, which evicts it."),
        notes=("pool-null-block", "pool-free-queue", "pool-get-new", "pool-evict-on-reuse", "pool-touch",
               "pool-free-order", "pool-cached-lookup", "pool-cache-full", "pool-usage"),
    ),
    Component(
        "kv_cache_manager", REFERENCE["kv_cache_manager"],
        methods=("__init__", "register", "get_computed_blocks", "allocate_slots", "free", "block_tables", "block_ids"),
        attributes=("block_pool", "enable_caching"),
        upstream=("vllm.v1.core.kv_cache_manager.KVCacheManager",
                  "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager"),
        doc=("Decides which physical blocks hold each request's tokens. get_computed_blocks finds the longest run of "
             "cached full blocks from the start of a request (at most num_tokens - 1 tokens can hit: the last one must "
             "run to give logits). allocate_slots takes references on the hits, then new blocks from the pool for the "
             "rest, or returns None when the pool cannot give them (the scheduler then preempts or stops admitting), "
             "and hashes every block that will be full after this step. free returns a request's blocks tail first. "
             "The engine passes the pool class in (block_pool_cls): build the pool from it."),
        notes=("kvm-hit-cap", "kvm-find-longest", "kvm-alloc-fail", "kvm-attach-hit", "kvm-cache-blocks",
               "kvm-free-reverse", "kvm-new-blocks", "kvm-hash-chain", "kvm-hash-full-only"),
    ),
    Component(
        "scheduler", REFERENCE["scheduler"],
        methods=("__init__", "add_request", "has_unfinished", "schedule", "update_from_output"),
        attributes=("waiting", "running", "requests", "max_num_seqs"),
        upstream=("vllm.v1.core.sched.scheduler.Scheduler",),
        doc=("One step's decision: a token budget shared by all requests, no prefill or decode phases. Running "
             "requests go first, in order; each gets min(tokens it still needs, budget left), so a long prompt is "
             "chunked. When allocate_slots fails for a running request the newest running request is preempted (its "
             "blocks freed, it goes back to the front of the waiting queue) until it fits. Then waiting requests are "
             "admitted in order, after a prefix-cache lookup, while the budget, max_num_seqs and the pool allow. "
             "update_from_output appends the sampled tokens, stops finished requests and frees their blocks."),
        notes=("sched-queues", "sched-token-budget-config", "sched-running-loop", "sched-num-new-tokens",
               "sched-allocate-running", "sched-pick-victim", "sched-preempt-self", "sched-waiting-gate",
               "sched-prefix-lookup", "sched-allocate-waiting", "sched-admit", "sched-preempt-reset",
               "sched-preempt-prepend", "sched-update-from-output", "sched-check-stop"),
    ),
    Component(
        "paged_attention", REFERENCE["paged_attention"],
        methods=(),
        attributes=(),
        upstream=("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",),
        doc=("Attention over a flattened batch whose KV lives in fixed-size blocks. First write this step's K/V into "
             "the cache at meta.slot_mapping (slot = block_id * block_size + offset), then for each request read all "
             "its K/V back through its block table and attend causally: its query tokens are the last query_len "
             "positions of its sequence. Returns [num_tokens, num_heads * head_dim] in q's dtype."),
        notes=("attn-metadata-build", "attn-kv-write", "attn-kv-layout", "attn-read-block-table"),
    ),
    Component(
        "moe", "reimpl.ep:expert_parallel_moe",
        methods=(),
        attributes=(),
        upstream=("vllm.model_executor.models.qwen3_moe.Qwen3MoeSparseMoeBlock",
                  "vllm.model_executor.layers.fused_moe.expert_map_manager.determine_expert_map",
                  "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._maybe_reduce_final_output"),
        doc=("One MoE layer over a flattened batch, its experts split over ep_size ranks. Route every token (router "
             "logits = h @ gate_weight.T; keep the top_k; weights = softmax over the kept logits when renormalize, "
             "else their share of the full softmax). Place the experts as upstream's determine_expert_map does "
             "(linear: rank r holds a contiguous run; its expert map sends a global id to a local slot, -1 elsewhere). "
             "Each rank runs its local experts on the tokens routed to them, weighted; the all-reduce sums the "
             "ranks' partial outputs. Returns reimpl.moe.MoEOutput (output, routing, one RankPart per rank)."),
        notes=("moe-gate-logits", "moe-softmax-topk", "moe-renormalize", "ep-parallel-config", "ep-expert-map",
               "ep-final-all-reduce", "ep-cpu-global-ids"),
    ),
)}


def parse_impl(option: str) -> tuple[str, str]:
    """"COMPONENT=FILE.py[:Name]" -> (component, "FILE.py[:Name]")."""
    component, sep, spec = option.partition("=")
    if not sep or not component or not spec:
        raise TourError(f"--impl {option!r}: expected COMPONENT=FILE.py[:Name] (components: {', '.join(COMPONENTS)})")
    return component.strip(), spec.strip()


def load_impl(component: str, spec: str) -> object:
    """Import FILE.py by path and return its class/function for `component`, checked against the reference.

    spec: "FILE.py" or "FILE.py:Name" (default Name: the reference's). TourError (one line) if the
    file is missing or does not import, the name is missing, or a method is missing or takes other
    parameters than the reference's."""
    comp = _component(component)
    path_text, sep, name = spec.rpartition(":")
    if not sep or not name.isidentifier():
        path_text, name = spec, ""
    name = name or comp.reference_name
    label = f"--impl {component}={spec}"
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise TourError(f"{label}: no such file {path}")
    module_name = f"vllm_tour_impl_{component}_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None:
        raise TourError(f"{label}: {path} is not a Python file (FILE.py)")
    module = importlib.util.module_from_spec(module_spec)
    module.__package__ = "reimpl"  # a copied reference file's relative imports resolve against reimpl/
    sys.modules[module_name] = module  # dataclasses look their module up while the file runs
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # a learner's file may raise anything, SystemExit included
        sys.modules.pop(module_name, None)
        raise TourError(f"{label}: cannot import {path}: {_one_line(e)}") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise TourError(f"{label}: {path} has no {name}")
    check_impl(component, obj, label)
    return obj


def check_impl(component: str, obj: object, label: str | None = None) -> None:
    """TourError unless `obj` offers the component's interface (the reference's methods and parameters)."""
    comp = _component(component)
    label = label or f"impl {component}={getattr(obj, '__qualname__', obj)!r}"
    name = getattr(obj, "__name__", repr(obj))
    if comp.methods and not inspect.isclass(obj):
        raise TourError(f"{label}: {name} is not a class (the reference {comp.reference} is)")
    if not comp.methods and (inspect.isclass(obj) or not callable(obj)):
        raise TourError(f"{label}: {name} is not a function (the reference {comp.reference} is)")
    for method, ref_sig in comp.signatures().items():
        fn = getattr(obj, method, None) if comp.methods else obj
        if not callable(fn):
            raise TourError(f"{label}: {name} has no method {method}{_params(ref_sig)} (see the reference {comp.reference})")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: cannot check, the run will tell
        if not _compatible(ref_sig, sig):
            where = f"{name}.{method}" if comp.methods else name
            raise TourError(f"{label}: {where}{_params(sig)} does not match the reference's {method}{_params(ref_sig)}")


def _component(component: str) -> Component:
    if component not in COMPONENTS:
        raise TourError(f"unknown component {component!r} (known: {', '.join(COMPONENTS)})")
    return COMPONENTS[component]


def _compatible(ref: inspect.Signature, got: inspect.Signature) -> bool:
    """Every reference parameter is accepted at the same position under the same name (or by *args/**kwargs),
    and every extra parameter has a default."""
    P = inspect.Parameter
    positional = [p for p in got.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keyword_only = {p.name: p for p in got.parameters.values() if p.kind == P.KEYWORD_ONLY}
    var_pos = any(p.kind == P.VAR_POSITIONAL for p in got.parameters.values())
    var_kw = any(p.kind == P.VAR_KEYWORD for p in got.parameters.values())
    wanted = [p for p in ref.parameters.values() if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    for i, p in enumerate(wanted):
        if i < len(positional):
            if positional[i].name != p.name and p.kind != P.POSITIONAL_ONLY:
                return False
        elif p.kind == P.KEYWORD_ONLY:
            if p.name not in keyword_only and not var_kw:
                return False
        elif not var_pos:
            return False
    names = {p.name for p in wanted}
    extra = positional[len(wanted):] + [p for n, p in keyword_only.items() if n not in names]
    return all(p.default is not P.empty for p in extra)


def _params(sig: inspect.Signature) -> str:
    """The parameter list without annotations: (self, blocks, n=...)."""
    parts = []
    for p in sig.parameters.values():
        star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        parts.append(star + p.name + ("=..." if p.default is not inspect.Parameter.empty else ""))
    return f"({', '.join(parts)})"


def _one_line(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} (line {e.lineno})"
    return f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
