"""Async scheduling: decide step t+1 while the GPU still runs step t.

Upstream counterpart (v0.21.0, where it is on by default):
`vllm.v1.core.sched.async_scheduler.AsyncScheduler` (`_update_after_schedule`,
`_update_request_with_output`), with the placeholder checks in
`vllm.v1.core.sched.scheduler.Scheduler.schedule`.

The plain loop is schedule -> run -> wait for the sampled tokens -> update ->
schedule, so the GPU idles while Python schedules and the CPU idles while the
GPU runs. Here the engine schedules step t+1 *before* step t's tokens are
back. Every request that samples in step t gets a placeholder: a token that
exists, only not on the host yet. The next schedule treats it as known (one
more token to decode), the model runner copies its id from step t's sampled
tensor on the GPU, and when step t's results arrive the placeholder becomes
a real token.

What it costs: a request that stops on EOS in step t has already been given
step t+1, whose token is thrown away; admissions and frees happen one step
later than in the plain loop. Requests that stop on length never run the
extra step (the skip at the top of Scheduler.schedule's running loop).
"""

from __future__ import annotations

from .chunked_prefill import Scheduler, SchedulerOutput
from .request import Request


class AsyncScheduler(Scheduler):
    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        super()._update_after_schedule(out)
        for s in out.scheduled:
            request = self.requests[s.req_id]
            # a step that reaches the end of what will be known samples one token
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _update_request_with_output(self, request: Request, token_id: int) -> bool:
        request.num_output_placeholders -= 1
        assert request.num_output_placeholders >= 0
        return super()._update_request_with_output(request, token_id)
