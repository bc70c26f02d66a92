"""The actor that owns one :class:`~kvactors.tiers.base.SecondaryTier` plugin.

It calls the plugin's methods one at a time on its own thread, and turns
everything the plugin does wrong into that tier's failure: an exception in
``submit_*`` is a failed job, an exception in ``lookup`` is a ``RETRY`` answer,
an exception in a hook is logged and counted. Nothing a plugin raises reaches
the supervisor or the other tiers.

The only sender of messages to this actor is the supervisor (see
:mod:`kvactors.actors.supervisor` for why that matters).
"""

from __future__ import annotations

import torch

from kvactors.actors import messages as m
from kvactors.actors.runtime import Actor, ActorRef, ActorStoppedError, handles
from kvactors.tiers.base import SecondaryTier
from kvactors.types import JobResult, LookupResult


class SecondaryTierActor(Actor):
    """Runs one tier plugin; see the module docstring."""

    def __init__(self, tier: SecondaryTier) -> None:
        self.tier = tier
        self.name = f"tier-{tier.name}"
        self.supervisor: ActorRef
        self.tier_errors = 0

    def connect(self, supervisor: ActorRef, pool: torch.Tensor) -> None:
        """Attach the plugin; runs before the actor receives any message."""
        self.supervisor = supervisor
        self.tier.attach(pool, self._report)

    def _report(self, result: JobResult) -> None:
        """The plugin's ``report``: thread-safe, called from any thread."""
        if not isinstance(result, JobResult):
            self.log.error("job_report_invalid", tier=self.tier.name, value=repr(result))
            return
        try:
            self.supervisor.tell(m.JobReported(self.tier.name, result))
        except ActorStoppedError:
            # stop() already counted this job as failed; the report has nowhere to go.
            self.log.info("report_after_stop", tier=self.tier.name, job_id=result.job_id)

    def _failed(self, call: str, exc: BaseException, **context: object) -> None:
        self.tier_errors += 1
        self.log.warning("tier_call_failed", tier=self.tier.name, call=call, error=repr(exc), **context)

    @handles(m.TierNewRequest)
    def _on_new_request(self, msg: m.TierNewRequest) -> None:
        try:
            self.tier.on_new_request(msg.ctx)
        except BaseException as exc:
            self._failed("on_new_request", exc, req_id=msg.ctx.req_id, attempt=msg.ctx.attempt)

    @handles(m.TierFinished)
    def _on_finished(self, msg: m.TierFinished) -> None:
        self.log.debug("tier_finish_received", tier=self.tier.name, req_id=msg.ctx.req_id, attempt=msg.ctx.attempt)
        try:
            self.tier.on_request_finished(msg.ctx)
        except BaseException as exc:
            self._failed("on_request_finished", exc, req_id=msg.ctx.req_id, attempt=msg.ctx.attempt)

    @handles(m.TierTouch)
    def _on_touch(self, msg: m.TierTouch) -> None:
        try:
            self.tier.touch(msg.keys, msg.ctx)
        except BaseException as exc:
            self._failed("touch", exc)

    @handles(m.TierSubmit)
    def _on_submit(self, msg: m.TierSubmit) -> None:
        job = msg.job
        ctx = job.req_context
        self.log.debug("tier_submit_received", tier=self.tier.name, job_id=job.job_id, promotion=job.is_promotion,
                       req_id=ctx.req_id, attempt=ctx.attempt)
        try:
            if job.is_promotion:
                self.tier.submit_load(job)
            else:
                self.tier.submit_store(job)
        except BaseException as exc:
            self._failed("submit_load" if job.is_promotion else "submit_store", exc, job_id=job.job_id)
            self._report(JobResult(job.job_id, False, f"{type(exc).__name__}: {exc}"))

    @handles(m.TierLookup)
    def _on_lookup(self, msg: m.TierLookup) -> None:
        results: tuple[LookupResult, ...] | None
        try:
            answer = self.tier.lookup(msg.keys, msg.ctx)
            results = tuple(answer)
            if len(results) != len(msg.keys) or not all(isinstance(r, LookupResult) for r in results):
                raise TypeError(f"lookup returned {len(results)} values for {len(msg.keys)} keys")
        except BaseException as exc:
            self._failed("lookup", exc)
            results = None
        self.supervisor.tell(m.TierLookupAnswered(msg.lookup_id, self.tier.name, results))

    @handles(m.TierGather)
    def _on_gather(self, msg: m.TierGather) -> None:
        payload: tuple[object, ...] = ()
        try:
            if msg.what == "events":
                payload = tuple(self.tier.take_events())
            elif msg.what == "shutdown":
                try:
                    self.tier.drain(msg.timeout_s)
                finally:
                    self.tier.shutdown()
        except BaseException as exc:
            self._failed(msg.what, exc)
        self.supervisor.tell(m.TierGathered(msg.gather_id, self.tier.name, payload))
