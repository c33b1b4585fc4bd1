"""The one trace schema: what every probe (upstream) and the reimpl engine write.

Each process appends records to its own JSON Lines file; every record carries
`kind`, `step` and the process that wrote it. The reader merges files into one
`Step` per engine step. The reimpl mini engine writes the *same* records, so
`compare` diffs like with like.

Steps are counted by the process that owns the decision: the scheduler's step
is the number of `Scheduler.schedule` calls (1-based); workers count
`execute_model` calls, which upstream makes exactly once per schedule call.

Request ids are the user's (scenario) ids: upstream's "-<8 hex>" suffix is
stripped. Block ids are physical block ids of the first KV-cache group; block 0
is upstream's null block and never belongs to a request.

Upstream probes write the hot records (scheduler, kv, runner, attention) as
plain dicts with exactly these fields (cheaper than building models); the
reader validates every line against these classes. Three of their fields are
written in a compact form that the reader expands, so every reader sees the
full record: `scheduled` as columns (one list per field), and the KV and
attention block tables as deltas against the same process's previous record of
that kind (`*_since` names its step). A 64-request decode step then writes
~4 KB instead of ~16 KB, and changes ~2 tables of 64.

Bump SCHEMA_VERSION on any change that an old reader would misread.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

SCHEMA_VERSION = 2  # 2: compact scheduled / block tables (the reader still reads 1)


class Proc(BaseModel):
    """Who wrote a record: role (engine_core, worker, frontend, reimpl), pid, TP rank."""

    role: str
    pid: int
    rank: int = 0


class _Record(BaseModel):
    step: int
    proc: Proc


# --- scheduler ---------------------------------------------------------------


class ScheduledRequest(BaseModel):
    req_id: str
    # new: first time scheduled; resumed: back after preemption (recomputed);
    # running: continues (a decode, or the next chunk of a chunked prefill).
    kind: Literal["new", "resumed", "running"]
    num_scheduled_tokens: int
    num_computed_tokens: int  # before this step's tokens
    num_prompt_tokens: int
    num_output_tokens: int  # before this step
    is_prefill: bool  # this step's tokens include prompt tokens


class Preemption(BaseModel):
    req_id: str
    # Why: upstream preempts when allocate_slots() returns None for some request.
    reason: str
    while_allocating_for: str | None = None
    num_tokens_requested: int | None = None
    free_blocks_at_failure: int | None = None
    freed_block_ids: list[int] = []
    num_computed_tokens_lost: int = 0


class SchedulerRecord(_Record):
    kind: Literal["scheduler"] = "scheduler"
    time: float  # wall clock (time.time()) at the end of schedule()
    duration_s: float
    waiting_before: int
    running_before: int
    waiting_after: int
    running_after: int
    token_budget: int  # max_num_batched_tokens this step
    tokens_scheduled: int
    max_num_seqs: int
    scheduled: list[ScheduledRequest]
    preempted: list[Preemption]
    finished: list[str]  # finished since the previous step (their blocks show in this step's kv.freed)

    @field_validator("scheduled", mode="before")
    @classmethod
    def _rows_from_columns(cls, v):
        # The probes write {field: [value per request]}: the field names once, not once per request.
        if isinstance(v, dict):
            return [dict(zip(v, row)) for row in zip(*v.values())]
        return v


# --- KV-cache manager / block pool -------------------------------------------


class PrefixHit(BaseModel):
    req_id: str
    num_hit_tokens: int
    block_ids: list[int]


class KVRecord(_Record):
    kind: Literal["kv"] = "kv"
    num_blocks: int  # usable blocks in the pool (upstream reserves block 0 as the null block)
    block_size: int
    free_blocks: int
    usage: float  # fraction of the pool in use, as upstream reports it
    block_tables: dict[str, list[int]]  # req_id -> physical block ids, after this step's allocation
    # As written by the probes: block_tables holds only the tables that differ from the KV record of
    # step `block_tables_since` in the same file ([] for a request that no longer holds blocks); the
    # reader fills in the rest and clears this. None: block_tables is complete.
    block_tables_since: int | None = Field(None, exclude=True)
    allocated: dict[str, list[int]]  # req_id -> blocks newly given this step
    # Block ids returned to the free list since the previous KV record: preemptions
    # of this step, and requests that finished after the previous step.
    freed: list[int]
    evicted: list[int]  # cached blocks whose hash was dropped to reuse them
    prefix_hits: list[PrefixHit]
    prefix_caching: bool


# --- speculative decoding ------------------------------------------------------------


class SpecProposalRecord(_Record):
    """The drafts a proposer made after this step's tokens were sampled (upstream's EngineCore hands them to
    Scheduler.update_draft_token_ids after the step): the scheduler schedules them for verification at the
    next step, cut to what fits."""

    kind: Literal["spec_proposal"] = "spec_proposal"
    proposer: str  # speculative_config.method: ngram, eagle, draft_model, ...
    proposed: dict[str, list[int]]  # req_id -> draft token ids, as the proposer returned them ([]: no match)
    ignored: list[str]  # requests whose drafts the scheduler dropped (still prefilling, or finished)


class SpecVerification(BaseModel):
    """One request's drafts verified in one step (greedy: a draft is accepted while it equals the target's token)."""

    req_id: str
    num_computed_tokens: int  # before this step: the position of its first scheduled token (the last known token)
    draft_token_ids: list[int]  # scheduled for verification, at positions num_computed_tokens + 1, + 2, ...
    num_accepted: int  # the leading drafts the target model agreed with
    # what the target produced: the accepted drafts, then one token of its own (upstream's "bonus" token when
    # every draft was accepted, its correction at the first rejected position otherwise)
    sampled_token_ids: list[int]
    # KV slots written this step for the rejected drafts: they hold KV of tokens that are not in the sequence;
    # num_computed_tokens is rolled back over them and the next steps write the real tokens' KV there
    rejected_slots: list[int]
    # blocks that hold no token of the sequence after the rollback, only rejected drafts: kept by the request
    # (not freed), filled by its next tokens
    rejected_only_blocks: list[int]


class SpecVerifyRecord(_Record):
    """Written by Scheduler.update_from_output for the steps that verified drafts."""

    kind: Literal["spec_verify"] = "spec_verify"
    num_speculative_tokens: int  # the most drafts a request gets per step
    # KV slots the KV manager reserved past the scheduled tokens (allocate_slots(num_lookahead_tokens=...)):
    # for a drafter that writes KV of its own (eagle); 0 for ngram, whose drafts are only token ids
    num_lookahead_tokens: int
    requests: list[SpecVerification]


# --- model runner --------------------------------------------------------------


def int_digest(values) -> str:
    """IntList.sha256: sha256 of the values as little-endian int64 bytes (a list or a numpy array).

    Bytes, not text: the probes hash the runner's buffers as they are (a 2048-token
    prefill in ~5 us, against ~150 us for the decimal text of a Python list)."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.asarray(values, dtype="<i8").tobytes()).hexdigest()


class IntList(BaseModel):
    """A list recorded in full when small, else summarized (len, head, tail, sha256: see int_digest)."""

    full: list[int] | None = None
    length: int
    head: list[int] = []
    tail: list[int] = []
    sha256: str | None = None


class RunnerRecord(_Record):
    kind: Literal["runner"] = "runner"
    num_tokens: int
    req_ids: list[str]  # batch order as the runner laid it out
    num_scheduled_tokens: list[int]  # per req_ids entry
    input_ids: IntList
    positions: IntList
    query_start_loc: list[int]
    seq_lens: list[int]
    slot_mapping: IntList
    logits_indices: list[int]
    sampled_token_ids: dict[str, list[int]]


# --- attention backend -----------------------------------------------------------


class AttentionLayer(BaseModel):
    layer: str
    kv_cache_shape: list[int]
    kv_cache_dtype: str


class AttentionRecord(_Record):
    kind: Literal["attention"] = "attention"
    backend: str
    layout: str | None = None
    # CPU_ATTN: the kernel ISA upstream's _get_attn_isa picked (vec, vec16, amx, ...): it decides
    # the KV-cache memory layout and the order of the attention's bf16 sums. None on CUDA.
    isa: str | None = None
    num_reqs: int
    seq_lens: list[int]
    query_lens: list[int]
    block_table: list[list[int]]  # rows the backend received, batch order (trailing zeros = null block trimmed)
    # As written by the probes: block_table holds only the rows at indexes `block_table_rows` that differ
    # from the attention record of step `block_table_since` in the same file (rows past num_reqs dropped);
    # the reader fills in the rest and clears both. None: block_table is complete.
    block_table_since: int | None = Field(None, exclude=True)
    block_table_rows: list[int] | None = Field(None, exclude=True)
    layers: list[AttentionLayer]  # only layers whose shape/dtype differ from the first are listed after it
    # The model's attention shape as the backend holds it (None: recorded before these fields): how many
    # layers this metadata serves, and the KV-cache spec's KV heads (per TP rank) and head size.
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None


# --- mixture of experts ---------------------------------------------------------------


class MoERecord(_Record):
    """One MoE layer's routing as this rank's experts kernel received it (written before the kernel runs,
    so a kernel that kills the process still leaves it)."""

    kind: Literal["moe"] = "moe"
    layer: int  # decoder layer index
    num_tokens: int
    num_experts: int  # global experts of the layer
    num_local_experts: int  # experts whose weights this rank holds (rows of the kernel's weight tables)
    expert_map: list[int] | None  # global expert id -> local slot on this rank, -1 elsewhere; None: all local
    topk_ids: list[list[int]]  # per token, the expert ids handed to the kernel, in upstream's order
    topk_weights: list[list[float]]  # per token, same order
    tokens_per_expert: list[int]  # global expert id -> tokens routed to it (top-k over this rank's batch)
    local_tokens_per_expert: list[int]  # local slot -> tokens this rank's expert computes (via expert_map)
    kernel: str  # the experts implementation, e.g. "CPUUnquantizedExperts/vec"


# --- captures and errors -------------------------------------------------------------


class CaptureRecord(_Record):
    kind: Literal["capture"] = "capture"
    name: str  # e.g. "attn_out.layers.0", "kv_blocks.layers.0"
    file: str  # safetensors file beside the trace, relative to the run dir
    tensor: str  # key inside that file
    shape: list[int]
    dtype: str
    # kv_blocks.*: the physical block ids of the captured rows, in tensor order.
    block_ids: list[int] | None = None
    layout: str | None = None  # axis meaning when not obvious from the name
    isa: str | None = None  # kv_blocks.* on CPU: the attention ISA whose layout was decoded at capture


# --- tensor parallelism (written by each worker rank when TP > 1) -------------------------


class WeightShard(BaseModel):
    name: str  # upstream parameter name, e.g. model.layers.0.self_attn.qkv_proj.weight (fused)
    shape: list[int]
    dtype: str
    sha256: str  # of the shard's bytes as loaded on this rank, before any CPU weight repacking


class TPShardsRecord(_Record):
    """Once per rank, after the weights are loaded (step 0): what this rank holds."""

    kind: Literal["tp_shards"] = "tp_shards"
    world_size: int
    communicator: str  # the TP all-reduce path that runs: "cpu-shm", "gloo", "nccl", ...
    shards: list[WeightShard]
    file: str | None = None  # the shards as safetensors (captures/weights.rank<r>.safetensors) when capturing "tp"


class CollectiveRecord(_Record):
    """One TP collective of one rank: the tensor going in and the one coming out, as sha256
    (the tensors themselves in the step's capture file as tp.<op>_in/_out.<layer> when capturing "tp")."""

    kind: Literal["collective"] = "collective"
    op: Literal["all_reduce", "gather", "all_gather"]
    layer: str  # the upstream module whose output it combines (model.layers.0.self_attn.o_proj, logits)
    shape_in: list[int]
    shape_out: list[int] | None  # None: gather's result lives on rank 0 only
    dtype: str
    sha256_in: str
    sha256_out: str | None


class ProbeErrorRecord(_Record):
    kind: Literal["probe_error"] = "probe_error"
    probe: str
    target: str
    error: str
    traceback: str


class ProbeTargetRecord(_Record):
    """A probe target another plugin replaced (vLLM runs general plugins in no set order): the function
    found there is not upstream's, and the probe wraps it. Written at the first probe call of the process."""

    kind: Literal["probe_target"] = "probe_target"
    probe: str
    target: str
    replaced_by: str  # module.qualname of the function the probe wraps
    when: Literal["before_install", "after_install"]


# --- the OpenAI server (`vllm-tour serve`) -------------------------------------------------


class AbortRecord(_Record):
    """A request the EngineCore dropped before it finished on its own (upstream's Scheduler.finish_requests
    with FINISHED_ABORTED): a client that disconnected, a stop string the front end found, a shutdown.

    `step` is the engine step during which it was dropped: upstream handles aborts between a step's
    schedule() and its output update (or while idle, after the last step), so the request shows in the
    scheduler's `finished` and its blocks in `kv.freed` of the next step."""

    kind: Literal["abort"] = "abort"
    time: float  # wall clock when the scheduler dropped it
    req_id: str  # user id (upstream's "-<8 hex>" suffix stripped), as in the scheduler records
    status_before: str  # upstream RequestStatus it had: RUNNING, WAITING, PREEMPTED, ...
    num_computed_tokens: int
    num_output_tokens: int
    block_ids: list[int]  # its block table (first KV-cache group) when dropped
    freed_block_ids: list[int]  # of those, the blocks that went back to the free list (others are shared or cached)


class ServerRequestRecord(_Record):
    """One engine request as the OpenAI server's front end saw it, written when it finished or was aborted
    (role "frontend"; `step` is 0: the front end does not count engine steps). A chat or completion
    request with n > 1 is n engine requests ("<index>_<parent id>"), one record each."""

    kind: Literal["server_request"] = "server_request"
    api_id: str  # the id the client got: chatcmpl-..., cmpl-...
    req_id: str  # user id of the engine request, as in the scheduler records
    external_id: str  # what the server passed to the engine (completions: "<api id>-<prompt index>")
    parent_id: str | None = None  # n > 1: the parent's user id; None for a single request
    index: int = 0  # n > 1: which of the n choices
    n: int = 1
    arrival_time: float  # wall clock when the front end made the engine request
    first_token_time: float | None  # wall clock when its first token reached the front end (None: none did)
    finished_time: float
    finish_reason: str  # as the client saw it: stop, length, abort, error, ...
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    max_tokens: int | None = None
    prompt_token_ids: list[int]
    token_ids: list[int]  # output tokens the front end received from the engine
    text: str  # their text, as the front end detokenized it


Record = Annotated[
    Union[
        SchedulerRecord,
        KVRecord,
        RunnerRecord,
        AttentionRecord,
        CaptureRecord,
        TPShardsRecord,
        CollectiveRecord,
        ProbeErrorRecord,
        MoERecord,
        ProbeTargetRecord,
        AbortRecord,
        ServerRequestRecord,
        SpecProposalRecord,
        SpecVerifyRecord,
    ],
    Field(discriminator="kind"),
]


# --- run files ------------------------------------------------------------------------


class RequestSpec(BaseModel):
    """One request: as a scenario file gives it (`id`, `prompt` or `token_ids`) and as meta.json
    records it after the run (`req_id`, `prompt_token_ids` filled in from the tokenizer)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    req_id: str = Field(validation_alias=AliasChoices("req_id", "id"))
    prompt: str | None = None
    prompt_token_ids: list[int] | None = Field(None, validation_alias=AliasChoices("prompt_token_ids", "token_ids"))
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    arrival_step: int = 0  # added before the driver's step with this index: 0 -> scheduled from step 1
    # None: not given (the engine stops at EOS); in meta.json, a run recorded before runs carried it
    ignore_eos: bool | None = None


class RunMeta(BaseModel):
    """meta.json: what was run, where, with what."""

    schema_version: int = SCHEMA_VERSION
    tool_version: str
    side: Literal["upstream", "reimpl"]
    pin: str
    vllm_version: str | None
    model: str
    model_path: str
    model_digest: str | None = None
    # "checkpoint": the model's own weights; "dummy": upstream's load_format="dummy" (random values in the
    # model's real shapes); "generated": a tiny model's seeded weights. None: recorded before this field.
    weights: Literal["checkpoint", "dummy", "generated"] | None = None
    weights_note: str | None = None  # what in this trace is the model's and what is not, in words
    # What was recorded (trace/levels.py). Runs recorded before levels existed hold everything: full.
    level: Literal["steps", "blocks", "full"] = "full"
    engine_args: dict
    requests: list[RequestSpec]
    env: dict[str, str]  # allow-listed variables only: never secrets
    platform: dict[str, str]
    started: float
    finished: float | None = None
    # "interrupted": stopped by the user (Ctrl-C); what was flushed up to then stays readable
    status: Literal["running", "ok", "failed", "interrupted"] = "running"
    error: str | None = None


class RequestOutput(BaseModel):
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    # Only when logprobs were asked for (bf16 scenarios, or `trace --logprobs K`): per generated
    # position, the ids of upstream's top-k tokens by rank and their logprobs (compare's bf16 token rule).
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class Outputs(BaseModel):
    """outputs.json: generated tokens and text per request."""

    schema_version: int = SCHEMA_VERSION
    requests: list[RequestOutput]
