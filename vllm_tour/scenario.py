"""The one scenario model, shared by `trace`, `compare` and `repro`.

A scenario is a TOML file: which model and pin, the engine settings, the
requests (prompt text or token ids, sampling, the step at which each arrives)
and optional expectations that `repro` checks. Example:

    name = "preemption"
    description = "KV pool too small for three long decodes"
    [engine]
    num_blocks = 8
    max_model_len = 128
    [[requests]]
    id = "r0"
    prompt = "the quick brown fox"
    max_tokens = 70
    [expect]                 # optional: what `vllm-tour repro` checks, on every pin
    preempted = ["r0"]
    [expect."v0.21.0"]       # on that pin only, on top of [expect]
    never_scheduled = ["r0"]

`mode = "scheduler"` runs upstream's Scheduler alone (sched_harness.py);
`[engine.extra]` passes EngineArgs fields the typed [engine] keys lack.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from vllm_tour.errors import TourError
from vllm_tour.trace.schema import RequestSpec


class EngineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_size: int = 32  # CPU attention needs a multiple of 32
    num_blocks: int | None = None  # usable KV blocks (upstream adds one null block)
    kv_cache_memory_bytes: int | None = None  # when num_blocks is unset: engine.run.default_kv_bytes (64 MiB, or more for a larger model)
    max_num_batched_tokens: int | None = None  # token budget per step (small: chunked prefill)
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts sharded across the TP ranks (upstream EngineArgs)
    max_model_len: int = 1024  # with num_blocks and no explicit value: what the pool can hold
    seed: int = 0
    dtype: Literal["float32", "float", "bfloat16", "float16", "half", "auto"] = "float32"  # vLLM's names
    # vLLM's load_format: "dummy" initialises random weights in the model's shapes without reading a
    # checkpoint (models.resolve_model then builds a shipped architecture, e.g. Qwen3-0.6B, offline)
    load_format: Literal["auto", "dummy"] = "auto"
    # Upstream attention backend (e.g. TRITON_ATTN, FLASH_ATTN); None: the pin's default
    # (pins/<tag>.toml [profile] default_attention_backend: CPU_ATTN on v0.32.0, TRITON_ATTN on v0.21.0).
    attention_backend: str | None = None
    # CPU_ATTN kernel ISA; None: upstream's choice (amx for bf16 on AMX CPUs, else vec). Forcing
    # "vec" on an AMX machine traces the other kernel and KV layout (probes/cpu_isa.py).
    cpu_attention_isa: Literal["vec", "vec16", "amx"] | None = None
    # Upstream EngineArgs fields the typed ones above do not cover (e.g. long_prefill_token_threshold,
    # async_scheduling, kv_events_config), passed as given; a name EngineArgs lacks fails before a start.
    extra: dict[str, Any] = {}

    @model_validator(mode="after")
    def _check(self):
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"block_size must be a positive multiple of 32 on CPU, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if self.max_model_len < 2:  # a prompt needs one position and the first generated token another
            raise ValueError(f"max_model_len must be at least 2 (one prompt token and one generated), got {self.max_model_len}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_blocks is not None:
            # Upstream refuses to start unless one max-length sequence fits the pool.
            capacity = self.num_blocks * self.block_size
            if "max_model_len" not in self.model_fields_set:
                self.max_model_len = min(self.max_model_len, capacity)
            elif self.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len {self.max_model_len} does not fit in num_blocks {self.num_blocks} x block_size "
                    f"{self.block_size} = {capacity} tokens; lower max_model_len to <= {capacity}"
                )
        if self.tensor_parallel_size not in (1, 2):
            raise ValueError("tensor_parallel_size must be 1 or 2 on this CPU build")
        return self


class ExpectSpec(BaseModel):
    """What `vllm-tour repro` checks after the run; every key given must hold for REPRODUCED."""

    model_config = ConfigDict(extra="forbid")

    engine_fails_with: str | None = None  # the engine fails, its error (or an ERROR log line) contains this
    preempted: list[str] = []  # each of these requests is preempted at least once
    resumed: list[str] = []  # each of these requests is scheduled again after a preemption
    prefix_hit_tokens: dict[str, int] = {}  # request -> at least this many prompt tokens from the prefix cache
    tokens_equal: list[str] = []  # these requests generate identical token ids
    # MoE: each EP rank's expert map (global expert -> local slot, -1 elsewhere) as its experts kernel got it
    expert_maps: dict[int, list[int]] = {}
    # MoE: true = some rank's experts kernel was handed top-k ids past its local expert count (global ids
    # not translated through the expert map); false = every id it got indexes one of its experts
    moe_kernel_ids_out_of_range: bool | None = None
    never_scheduled: list[str] = []  # these requests arrive and are never given a token in the run
    # request -> N: its computed tokens stop growing for at least N consecutive steps in which it is
    # unfinished and the engine schedules other requests
    stalled: dict[str, int] = {}
    max_scheduled_tokens: dict[str, int] = {}  # request -> at most this many tokens scheduled in any one step
    # waiting request -> an earlier waiting request: at some step both wait, the first would fit
    # (free blocks, token budget) but is not admitted while the earlier one does not fit
    blocked_behind: dict[str, str] = {}
    # KV events (scheduler mode, engine.extra.kv_events_config on): block hashes per event type, exactly
    # (BlockStored, BlockRemoved, AllBlocksCleared)
    kv_events: dict[Literal["BlockStored", "BlockRemoved", "AllBlocksCleared"], int] = {}
    # true: some BlockRemoved names a hash while another stored copy of it is still cached
    kv_removed_while_cached: bool | None = None
    # request -> true: it generates the same tokens when run alone (batch invariance), false: other tokens;
    # repro runs the engine once more per request, with that request only
    same_tokens_alone: dict[str, bool] = {}
    # speculative decoding: these requests get drafts verified that hold a token their own sequence (prompt and
    # output) never holds: not an n-gram proposal, which only copies tokens of the sequence
    drafts_not_in_sequence: list[str] = []

    def keys(self) -> list[str]:
        return [k for k in type(self).model_fields if getattr(self, k) not in (None, [], {})]

    def request_ids(self) -> set[str]:
        return {*self.preempted, *self.resumed, *self.prefix_hit_tokens, *self.tokens_equal, *self.never_scheduled,
                *self.stalled, *self.max_scheduled_tokens, *self.blocked_behind, *self.blocked_behind.values(),
                *self.same_tokens_alone, *self.drafts_not_in_sequence}

    def merged(self, other: "ExpectSpec | None") -> "ExpectSpec":
        """These expectations with `other`'s keys (a pin's own section) on top."""
        if other is None:
            return self
        return self.model_copy(update={k: getattr(other, k) for k in other.keys()})


class RequestOptions(BaseModel):
    """Upstream request fields the scenario's requests do not type (scheduler mode: they shape block hashes
    and KV events, which is all the scheduler reads of them)."""

    model_config = ConfigDict(extra="forbid")

    cache_salt: str | None = None
    lora_name: str | None = None  # a LoRARequest with this name (path /lora/<name>): the scheduler hashes it, never loads it
    sampling_extra_args: dict[str, Any] = {}  # SamplingParams.extra_args, e.g. kv_cache_report_mode = "full"


Verdict = Literal["REPRODUCED", "NOT REPRODUCED"]
_PIN_KEY = re.compile(r"^v\d+\.\d+\.\d+")


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""  # Markdown (`code`), as the site renders it
    description_zh: str = ""  # the same in Chinese: the site's 中文 mode (the English one where empty)
    model: str = "tiny-qwen3"
    pin: str | None = None  # None: the pin of the installed vLLM
    engine: EngineSpec = EngineSpec()
    requests: list[RequestSpec]
    expect: ExpectSpec | None = None  # checked by `repro` (trace and compare ignore it), on every pin
    # [expect."v0.21.0"]: a pin's own expectations, on top of [expect] (read from the [expect] table)
    expect_by_pin: dict[str, ExpectSpec] = {}
    # What `repro --all` holds each pin's verdict to (a fix that landed: NOT REPRODUCED there);
    # a pin with expectations and no entry here is expected REPRODUCED.
    verdicts: dict[str, Verdict] = {}
    issue: int | None = None  # the upstream issue and pull request the repro encodes
    pr: int | None = None
    notes: list[str] = []  # ids of the notes on the code the repro exercises (the site's repro page links them)
    # "engine": the whole upstream engine runs the model; "scheduler": upstream's Scheduler alone, fed
    # fabricated model outputs (sched_harness.py): no model forward, seconds on CPU
    mode: Literal["engine", "scheduler"] = "engine"
    max_steps: int = 200  # scheduler mode: the harness stops here, requests unfinished (a stall is a result)
    request_options: dict[str, RequestOptions] = {}  # request id -> its untyped upstream options (scheduler mode)
    # scheduler mode: right after scheduling this step (its batches still in flight), call
    # Scheduler.reset_prefix_cache(reset_running_requests=True), as LLM.reset_prefix_cache does on a live engine
    reset_prefix_cache_at_step: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _split_expect(cls, data):
        """[expect."v0.32.0"] sub-tables become expect_by_pin; the rest of [expect] stays common."""
        if isinstance(data, dict) and isinstance(data.get("expect"), dict):
            common = {k: v for k, v in data["expect"].items() if not _PIN_KEY.match(k)}
            by_pin = {k: v for k, v in data["expect"].items() if _PIN_KEY.match(k)}
            if by_pin:
                data = {**data, "expect": common or None, "expect_by_pin": by_pin}
        return data

    def pins(self) -> list[str]:
        """The pins this repro speaks about; [] = every pin (a plain [expect] only)."""
        return sorted({*self.expect_by_pin, *self.verdicts})

    def expect_for(self, pin: str) -> ExpectSpec | None:
        """The expectations checked on `pin`: [expect] with [expect."<pin>"] on top (None: none for it)."""
        own = self.expect_by_pin.get(pin)
        if self.expect is None:
            return own
        return self.expect.merged(own)

    def declared_verdict(self, pin: str) -> Verdict:
        return self.verdicts.get(pin, "REPRODUCED")

    @model_validator(mode="after")
    def _check(self):
        if not self.requests:
            raise ValueError("a scenario needs at least one request")
        for r in self.requests:
            _check_request(r)
        ids = [r.req_id for r in self.requests]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate request ids: {', '.join(dup)}")
        for ex in [self.expect, *self.expect_by_pin.values()]:
            if ex is None:
                continue
            unknown = sorted(ex.request_ids() - set(ids))
            if unknown:
                raise ValueError(f"expect names unknown request ids: {', '.join(unknown)}")
            if len(ex.tokens_equal) == 1:
                raise ValueError("expect.tokens_equal needs at least two request ids")
            if ex.same_tokens_alone and self.mode == "scheduler":
                raise ValueError('expect.same_tokens_alone compares generated tokens: it needs mode = "engine"')
            if ex.drafts_not_in_sequence and self.mode == "scheduler":
                raise ValueError('expect.drafts_not_in_sequence reads the drafts a model runner made: it needs mode = "engine"')
            for rid, earlier in ex.blocked_behind.items():
                if rid == earlier:
                    raise ValueError(f"expect.blocked_behind: {rid} cannot wait behind itself")
        unknown = sorted(set(self.request_options) - set(ids))
        if unknown:
            raise ValueError(f"request_options names unknown request ids: {', '.join(unknown)}")
        if (self.request_options or self.reset_prefix_cache_at_step is not None) and self.mode != "scheduler":
            raise ValueError('request_options and reset_prefix_cache_at_step are the scheduler-only harness\'s: '
                             'set mode = "scheduler"')
        for pin in self.verdicts:
            if self.expect_for(pin) is None:
                raise ValueError(f"verdicts names pin {pin} but there are no expectations for it")
        return self

    def check_model(self, model_dir: Path) -> None:
        """What only the model can tell, checked before an engine starts (upstream checks it after):
        every token id in the vocabulary, every prompt shorter than max_model_len (upstream wants room
        for one generated token), max_model_len within the model's positions."""
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        positions = cfg.get("max_position_embeddings")
        if positions and self.engine.max_model_len > positions:
            raise TourError(f"engine.max_model_len {self.engine.max_model_len} is more than model {self.model}'s "
                            f"max_position_embeddings {positions}")
        tokenizer = _tokenizer(model_dir)
        # As upstream: an id is in the vocabulary when the model or the tokenizer knows it.
        vocab = max(cfg.get("vocab_size", 0), tokenizer.get_vocab_size() if tokenizer else 0)
        for r in self.requests:
            ids = r.prompt_token_ids if r.prompt_token_ids is not None else tokenizer.encode(r.prompt).ids if tokenizer else None
            if ids is None:
                continue
            if r.prompt_token_ids is not None and vocab and max(ids) >= vocab:
                raise TourError(f"request {r.req_id}: token id {max(ids)} is outside model {self.model}'s vocabulary "
                                f"(ids 0..{vocab - 1})")
            longest = self.engine.max_model_len - 1  # one position stays for the first generated token
            if len(ids) > longest:
                raise TourError(f"request {r.req_id}: the prompt is {len(ids)} tokens; engine.max_model_len "
                                f"{self.engine.max_model_len} allows at most {longest} (one position stays for the "
                                "first generated token)")
            # Upstream would silently clamp max_tokens to the room left (max_model_len - prompt): a max_tokens the
            # user gave is refused instead, so a run never generates fewer tokens than asked without saying so.
            # The default (16) is no request: a prompt that leaves less room generates what fits, as upstream does.
            room = self.engine.max_model_len - len(ids)
            if r.max_tokens > room and "max_tokens" in r.model_fields_set:
                raise TourError(f"request {r.req_id}: max_tokens {r.max_tokens} does not fit: the prompt is {len(ids)} "
                                f"tokens and engine.max_model_len {self.engine.max_model_len} leaves room for at most "
                                f"{room} generated tokens (lower --max-tokens or raise --max-model-len)")


def _check_request(r: RequestSpec) -> None:
    """What a scenario's request must be before it runs (meta.json's copy also has the tokenized prompt)."""
    if (r.prompt is None) == (r.prompt_token_ids is None):
        raise ValueError(f"request {r.req_id}: give exactly one of prompt or token_ids")
    if r.prompt == "" or r.prompt_token_ids == []:
        raise ValueError(f"request {r.req_id}: the prompt is empty")
    if r.prompt_token_ids and min(r.prompt_token_ids) < 0:
        raise ValueError(f"request {r.req_id}: token id {min(r.prompt_token_ids)} is negative")
    if r.max_tokens < 1:
        raise ValueError(f"request {r.req_id}: max_tokens must be at least 1")
    if r.temperature < 0:
        raise ValueError(f"request {r.req_id}: temperature must be >= 0 (0: greedy), got {r.temperature}")
    if r.arrival_step < 0:
        raise ValueError(f"request {r.req_id}: arrival_step must be >= 0")


def _tokenizer(model_dir: Path):
    """The model's fast tokenizer (None when it ships only a slow one: text prompts are not measured)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def scenario_from_dict(data: dict, source: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise TourError(f"invalid {source}: {_first_error(e)}") from None


def load_scenario(path: Path | str) -> Scenario:
    """Read a scenario TOML; every problem is one TourError line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise TourError(f"scenario file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TourError(f"malformed TOML in {path}: {e}") from None
    except UnicodeDecodeError:
        raise TourError(f"scenario file {path} is not UTF-8 text") from None
    return scenario_from_dict(data, f"scenario {path}")
