"""Probes for upstream's OpenAI server (`vllm-tour serve`): aborts in the EngineCore, requests in the front end.

EngineCore: `Scheduler.finish_requests` is where every abort lands (EngineCore.abort_requests, a client
that disconnected or a stop string the front end's detokenizer found; pause and shutdown abort all). The
probe names each dropped request, the blocks it held and which of them went back to the free list.

Front end (the API server process): `OutputProcessor.add_request` sees each engine request made, with
its parent for n > 1 (ParentRequest: children "<index>_<parent id>"); `RequestState.make_request_output`
sees every output the front end hands to a request's stream, the last one with the finish reason the
client gets (an abort's too: OutputProcessor.abort_requests makes that output). The ids, times and tokens
of a request are kept here while it runs and written as one ServerRequestRecord when it ends.

Checked on v0.32.0 only (own_pins_only): other pins run without them. The front-end probes are serve_only:
an offline trace's LLMEngine runs the same OutputProcessor, and its runs stay as they were.
"""

from __future__ import annotations

import re
import time

from vllm_tour.probes.base import Probe
from vllm_tour.trace.writer import RECORDER as R
from vllm_tour.trace.writer import user_req_id

PINS = ("v0.32.0",)
SCHED = "vllm.v1.core.sched.scheduler.Scheduler"
OUTPUT = "vllm.v1.engine.output_processor"

# --- EngineCore: aborts ---------------------------------------------------------------------


def _finish_before(self, request_ids, finished_status, *a, **kw):
    if finished_status.name != "FINISHED_ABORTED":
        return None
    # As upstream reads its argument: one id, several, or None for every request.
    ids = (request_ids,) if isinstance(request_ids, str) else list(self.requests) if request_ids is None else request_ids
    seen = []
    for rid in ids:
        req = self.requests.get(rid)
        if req is None or req.is_finished():
            continue  # upstream skips these too: already finished, or not in the engine
        # Copied now: freeing clears the request's block list.
        blocks = list(self.kv_cache_manager.coordinator.get_blocks(rid)[0])
        seen.append((req, req.status.name, req.num_computed_tokens, len(req._output_token_ids), blocks))
    return seen


def _finish_after(seen, result, self, *a, **kw):
    if not seen:
        return
    now = time.time()
    for req, status, computed, outputs, blocks in seen:
        R.write({  # a schema.AbortRecord, as a dict
            "step": R.sched_step,
            "proc": R.proc_dict("engine_core"),
            "kind": "abort",
            "time": now,
            "req_id": user_req_id(req.request_id),
            "status_before": status,
            "num_computed_tokens": computed,
            "num_output_tokens": outputs,
            "block_ids": [b.block_id for b in blocks if not b.is_null],
            # A block another request shares, or one upstream defers (an in-flight step may still write it),
            # keeps a reference: only those at zero are free again.
            "freed_block_ids": [b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null],
        })


finish_requests = Probe(
    name="scheduler.abort",
    level="steps",
    target=f"{SCHED}.finish_requests",
    params=("self", "request_ids", "finished_status"),
    records="each request the engine drops before it finishes (client disconnect, stop string, shutdown): "
    "the step, its status, computed and output tokens, its blocks and those freed",
    pins=PINS,
    before=_finish_before,
    after=_finish_after,
    own_pins_only=True,
)

# --- front end: the server's view of each request ---------------------------------------------

# Upstream's completion server asks the engine for "<api id>-<prompt index>" (one per prompt,
# entrypoints/openai/completion/serving.py); chat asks for the api id itself.
_COMPLETION_ITEM = re.compile(r"^(cmpl-.+)-(\d+)$")
_LIVE: dict[str, dict] = {}  # internal id -> what the record needs, while the request runs


def api_id(external_id: str) -> str:
    m = _COMPLETION_ITEM.match(external_id)
    return m.group(1) if m else external_id


def _add_before(self, request, prompt, parent_req=None, request_index=0, *a, **kw):
    if request.request_id in self.request_states:
        return  # a streaming-input update of a request already here
    params = request.sampling_params
    _LIVE[request.request_id] = {
        "external_id": request.external_req_id,
        "parent_id": user_req_id(parent_req.request_id) if parent_req is not None else None,
        "index": request_index,
        "n": parent_req.n if parent_req is not None else 1,
        "arrival_time": request.arrival_time,
        "first_token_time": None,
        "max_tokens": params.max_tokens if params is not None else None,
    }


add_request = Probe(
    name="frontend.add_request",
    level="steps",
    target=f"{OUTPUT}.OutputProcessor.add_request",
    params=("self", "request", "prompt", "parent_req", "request_index"),
    records="(with frontend.output) each engine request the server makes: its API id, parent (n > 1), arrival",
    pins=PINS,
    before=_add_before,
    role="frontend",
    own_pins_only=True,
    serve_only=True,
)


def _output_before(self, new_token_ids, pooling_output, finish_reason, stop_reason, *a, **kw):
    live = _LIVE.get(self.request_id)
    if live is None:
        return
    if new_token_ids and live["first_token_time"] is None:
        live["first_token_time"] = time.time()
    if finish_reason is None:
        return
    del _LIVE[self.request_id]
    det = self.detokenizer
    R.segment_boundary(None)
    R.write({  # a schema.ServerRequestRecord, as a dict
        "step": 0,
        "proc": R.proc_dict("frontend"),
        "kind": "server_request",
        "api_id": api_id(live["external_id"]),
        "req_id": user_req_id(self.request_id),
        **live,
        "finished_time": time.time(),
        "finish_reason": str(finish_reason),
        "stop_reason": stop_reason,
        "prompt_token_ids": list(self.prompt_token_ids or []),
        # the detokenizer has taken this output's tokens in already (process_outputs updates it first)
        "token_ids": list(det.output_token_ids) if det is not None else [],
        "text": getattr(det, "output_text", "") if det is not None else "",
    })


output = Probe(
    name="frontend.output",
    level="steps",
    target=f"{OUTPUT}.RequestState.make_request_output",
    params=("self", "new_token_ids", "pooling_output", "finish_reason", "stop_reason"),
    records="per engine request, when it ends: API id, engine id, parent, arrival and first-token times, "
    "finish reason as the client sees it (abort included), its tokens and text",
    pins=PINS,
    before=_output_before,
    role="frontend",
    own_pins_only=True,
    serve_only=True,
)

PROBES = [finish_requests, add_request, output]
