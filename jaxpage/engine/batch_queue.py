"""Async scheduling's engine loop (vLLM's step_with_batch_queue): a step is left running on the device while
the next one is scheduled and launched, its sampled tokens entering that step on the device.

``BatchQueue.step`` is ``LLMEngine.step`` with async scheduling: a step of plain requests
(AsyncScheduler.runs_ahead) is left in flight; the next call schedules and launches the step after it (its tokens
taken from the device) before it reads this one's, so outputs come a step late. A step that cannot be scheduled
ahead waits for the step in flight first, and is itself read at the start of the next call when this one has
outputs to return (DESIGN.md, the step). The engine's own operations (schedule, prepare, update) are the
synchronous step's.
"""
from __future__ import annotations

import dataclasses

from jaxpage.core.scheduler_output import sampled_rows
from jaxpage.outputs import RequestOutput


@dataclasses.dataclass
class InFlight:
    """A launched step whose tokens the host has not read: the runner's handle, and the rows whose sequences
    hold placeholders for them."""

    launched: object  # the runner's LaunchedStep
    rows: list[int]
    first_tokens: bool = False  # it samples some request's first token


class BatchQueue:
    def __init__(self, engine):
        self.engine = engine  # the LLMEngine whose steps these are
        self.in_flight: InFlight | None = None  # the decode step left running on the device
        # a launched step that is not the decode fast path, read at the start of the next step(): the step
        # before's outputs go out while it runs, not after it
        self.unread = None
        self.ready: list[RequestOutput] = []  # outputs of a step in flight read outside step(), for the next

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        outputs, self.ready = self.ready, []
        if self.unread is not None:
            outputs += self._read_unread()
        elif self.in_flight is not None:
            # a step with first tokens is read before the next is scheduled: their TTFT does not wait a step more
            ahead = engine.scheduler.schedule_ahead() if not self.in_flight.first_tokens else None
            if ahead is not None:
                return outputs + self._run_ahead(ahead)
            outputs += self._finish_in_flight()
        planned, failures = engine.schedule()
        outputs += failures
        if not planned:
            return outputs
        failed: dict[str, Exception] = {}
        scheduled, bitmask = engine.prepare(planned, failed)
        launched = engine.runner.launch(scheduled, bitmask)
        if not failed and engine.scheduler.runs_ahead(planned):
            self._hold(launched)
            return outputs
        if outputs and not failed:
            self.unread = launched
            return outputs
        return outputs + engine.update(scheduled, engine.runner.fetch(launched), failed)

    def _run_ahead(self, ahead) -> list[RequestOutput]:
        """The step scheduled while the one in flight runs: launched on that step's tokens, then that step read."""
        engine = self.engine
        scheduled = engine.apply(ahead)
        if not scheduled:  # every row's request must compute a prefix the disk tier failed to load
            return self._finish_in_flight()
        launched = engine.runner.launch(scheduled, previous=self.in_flight.launched)
        # asked before the read: a request ending there must not make this step synchronous (read at once, two
        # steps' tokens in one call, the device idle while the next step is scheduled)
        holds = engine.scheduler.runs_ahead(scheduled)
        outputs = self._finish_in_flight()
        if holds:
            self._hold(launched)
            return outputs
        return outputs + self._finish(launched, self._live_rows(launched))  # it verifies drafts

    def wait(self) -> None:
        """Waits for the step in flight or unread, if any, and takes its tokens: the queues are then as after a
        synchronous step. Its outputs come with the next ``step()``."""
        if self.unread is not None:
            self.ready += self._read_unread()
        if self.in_flight is not None:
            self.ready += self._finish_in_flight()

    def drop(self, request_id: str) -> None:
        """Before a request is aborted: the steps waited for, and none of its outputs kept for the next step."""
        self.wait()
        self.ready = [o for o in self.ready if o.request_id != request_id]

    def _hold(self, launched) -> None:
        """Leaves a launched step in flight: its live rows' sequences get placeholders for their tokens."""
        rows = self._live_rows(launched)
        held = [launched.scheduled[i] for i in rows]
        first = any(s.samples and s.seq.num_output_tokens == 0 for s in held)
        self.engine.scheduler.add_placeholders(held)
        self.in_flight = InFlight(launched, rows, first) if rows else None

    @staticmethod
    def _live_rows(launched) -> list[int]:
        """The rows of a launched step whose sequence has not ended since its launch."""
        return [i for i, s in enumerate(launched.scheduled) if s.seq.finish_reason is None]

    def _finish_in_flight(self) -> list[RequestOutput]:
        """The step in flight's tokens read and taken by the scheduler as a synchronous step's."""
        flight, self.in_flight = self.in_flight, None
        self.engine.scheduler.remove_placeholders([flight.launched.scheduled[i] for i in flight.rows])
        return self._finish(flight.launched, flight.rows)

    def _read_unread(self) -> list[RequestOutput]:
        """The unread step's tokens, waited for and taken as a synchronous step's."""
        launched, self.unread = self.unread, None
        return self.engine.update(launched.scheduled, self.engine.runner.fetch(launched), {})

    def _finish(self, launched, rows: list[int]) -> list[RequestOutput]:
        """A launched step's tokens read, those of ``rows`` taken (a row whose sequence ended since its launch
        computed tokens that are dropped)."""
        sampled = self.engine.runner.fetch(launched)
        scheduled = [launched.scheduled[i] for i in rows]
        if len(rows) != len(launched.scheduled):
            sampled = sampled.rows(sampled_rows(launched.scheduled, rows))
        return self.engine.update(scheduled, sampled, {})
