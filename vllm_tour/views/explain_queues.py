"""The waiting and running queues at every step of a run, rebuilt for `vllm-tour explain` from what the records
hold: arrivals (meta.requests, or the server's records on a served run), admissions, preemptions and finishes,
checked at every step against the queue lengths the scheduler recorded."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_tour.trace.reader import Run


@dataclass
class StepState:
    index: int
    waiting: list[str]  # the waiting queue as schedule() found it, head first
    running: list[str]  # the running list as schedule() found it, admission order
    consistent: bool  # the rebuilt queues have the lengths the scheduler recorded
    admitted: list[str] = field(default_factory=list)  # taken from the head of `waiting`, in queue order
    left: list[str] = field(default_factory=list)  # still waiting after admission (before this step's victims join)
    running_after: list[str] = field(default_factory=list)  # running once admission ended
    victims_last: bool = True  # each victim was the last of running when it was picked


class _Timeline:
    """The waiting and running queues at every step, rebuilt from arrivals, admissions, preemptions, finishes."""

    def __init__(self, run: Run):
        self.run = run
        self.arrived: dict[str, int] = {}  # request -> the first step it was in the engine
        self.finish_step: dict[str, int] = {}  # request -> the step that computed its last token (or dropped it)
        done = {o.req_id for o in run.outputs.requests if o.finish_reason} if run.outputs else set()
        for s in run.steps:
            if s.scheduler:
                for r in s.scheduler.scheduled:
                    if r.req_id in done:
                        self.finish_step[r.req_id] = s.index
            for a in s.aborts:  # dropped between this step's schedule() and its update: gone from the queues after it
                self.finish_step[a.req_id] = s.index
        self.states: dict[int, StepState] = {}
        self._rebuild()

    def _rebuild(self) -> None:
        served = bool(self.run.server_requests)
        # Offline: the driver (engine/run.py _drive) adds, before engine step d+1, every request with arrival_step
        # <= d, and the next one whatever its arrival_step when the engine has nothing unfinished; in request order.
        # Served: clients add requests whenever they like; see _arrivals_served.
        pending = (sorted(self.run.server_requests, key=lambda r: r.arrival_time) if served
                   else sorted(self.run.meta.requests, key=lambda r: r.arrival_step))
        waiting: list[str] = []
        running: list[str] = []
        finished: set[str] = set()
        arrivals_known = True  # served: once a step's newcomers cannot be told, no later step's can
        for s in self.run.steps:
            sch = s.scheduler
            if served:
                if sch is None:
                    continue
                arrivals_known = arrivals_known and self._arrivals_served(s, pending, waiting)
            else:
                d = s.index - 1
                while pending and (pending[0].arrival_step <= d or not (set(self.arrived) - finished)):
                    rid = pending.pop(0).req_id
                    self.arrived[rid] = s.index
                    waiting.append(rid)
                if sch is None:
                    continue
            st = StepState(s.index, list(waiting), list(running),
                           consistent=arrivals_known and (len(waiting), len(running)) == (sch.waiting_before, sch.running_before))
            victims = [p.req_id for p in sch.preempted]
            for v in victims:  # the running loop pops victims from the tail (FCFS)
                st.victims_last &= bool(running) and running[-1] == v
                if v in running:
                    running.remove(v)
            admitted = {r.req_id for r in sch.scheduled if r.kind in ("new", "resumed")}
            st.admitted = [w for w in waiting if w in admitted]
            if set(st.admitted) != set(waiting[: len(admitted)]):
                st.consistent = False  # admission is FCFS from the head: anything else is not this model
            st.left = [w for w in waiting if w not in admitted]
            running += st.admitted
            st.running_after = list(running)
            waiting = list(st.left)
            for v in victims:  # each victim is prepended (sched-preempt-prepend)
                waiting.insert(0, v)
            for rid in [r for r in running + waiting if self.finish_step.get(r) == s.index]:
                (running if rid in running else waiting).remove(rid)
                finished.add(rid)
            self.states[s.index] = st

    def _arrivals_served(self, s, pending: list, waiting: list[str]) -> bool:
        """Move the requests that reached the engine before step `s` from `pending` to `waiting`; False when the
        records cannot say which they were.

        Nothing records when a request reached the EngineCore. The front end records when it made each one, in
        the order the engine receives them; the scheduler records how many were waiting at the start of each step.
        The newcomers are the difference between that count and the requests still waiting from before, taken
        in front-end order -- each must have been made before this step's schedule() ended."""
        sch = s.scheduler
        new = sch.waiting_before - len(waiting)
        if new < 0 or new > len(pending) or any(r.arrival_time > sch.time for r in pending[:new]):
            return False
        for r in pending[:new]:
            self.arrived[r.req_id] = s.index
            waiting.append(r.req_id)
        del pending[:new]
        return True


# --- the explanation ---------------------------------------------------------------------------------------------
