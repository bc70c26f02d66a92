"""The event names of kvactors' logs, defined once: name, levels, required fields.

Two kinds of events exist.

* **Lifecycle** events are written by a manager's event logger (:func:`kvactors.logs.make_event_logger`).
  They go to the stdlib logger ``kvactors`` and to the JSON-lines event log that ``kvactors check-log`` replays.
  The checker handles exactly these names.
  ``tests/test_log_schema.py`` checks that by scanning the package's source.
  Every log call's name must be a literal of this module, or a lookup into
  :data:`JOB_SUBMITTED`/:data:`JOB_COMPLETED`, at a level listed here.
  Every name here must be emitted somewhere.
  The checker's handlers must be the lifecycle names.
* **Component** events come from a tier or the transfer engine (:func:`kvactors.logs.component_logger`).
  They go to stdlib only, and are never in an event log.

A new event, or a renamed one, must be added here first.
The event logger refuses a name not listed here when ``KVACTORS_STRICT_EVENTS=1``, which the test suite sets.
``check-log`` reports such a name found in a log as unknown, and the verdict cannot be OK.
Otherwise a renamed event would switch a rule off.

This module is plain data, so importing it costs nothing and configures nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

#: Fields every lifecycle event carries, stamped by the logger itself.
#: ``timestamp`` is wall-clock UTC, ISO 8601.
#: Logs written before it have ``ts``, monotonic seconds, instead. No rule reads either.
STAMPED = frozenset({"event", "level", "timestamp", "thread", "seq", "manager", "pid"})

#: The event a job of each kind logs when it is sent to its tier, and when its tier reported it.
#: Emitters look their name up here (``JOB_SUBMITTED[kind]``), so every name in the source is a literal of this module.
JOB_SUBMITTED: Mapping[str, str] = MappingProxyType({"cascade": "cascade_submitted",
                                                     "promotion": "promotion_submitted"})
JOB_COMPLETED: Mapping[str, str] = MappingProxyType({"cascade": "cascade_completed",
                                                     "promotion": "promotion_completed"})
#: The job kinds.
JOB_KINDS = tuple(JOB_SUBMITTED)


@dataclass(frozen=True, slots=True)
class EventSpec:
    """One event: its name, the levels it may be logged at and the fields it must carry."""

    name: str
    levels: frozenset[str]
    required: frozenset[str]
    lifecycle: bool = True  # False: a component event (stdlib only)
    doc: str = ""


def _spec(name: str, levels: str, required: str = "", doc: str = "", *, lifecycle: bool = True) -> EventSpec:
    return EventSpec(name, frozenset(levels.split()), frozenset(required.split()), lifecycle, doc)


_REQ = "req_id attempt"

_LIFECYCLE = (
    # the manager
    _spec("manager_started", "info", "tiers", "first event of a manager; tiers: cpu then the secondary tiers"),
    _spec("manager_stopped", "info", "", "last event of a manager: every actor's events are in before it"),
    _spec("stop_timed_out", "warning", "", "stop() spent its budget: what was in flight failed"),
    _spec("actor_abandoned", "warning", "actor", "an actor that did not stop in time, left behind (a daemon thread)"),
    _spec("call_unanswered", "error", "call", "a blocking call not answered long past its deadline (a wedged thread)"),
    _spec("runtime_stopping", "info", "jobs_in_flight active_requests", "the supervisor starts the stop"),
    _spec("shutdown_timeout_zero", "warning", "shutdown_timeout_s",
          "the vLLM engine runs with --shutdown-timeout 0: its stop will not wait for this manager's"),
    # the primary: request lifetime and the frontend's calls
    _spec("request_started", "debug", _REQ, "on_new_request admitted"),
    _spec("request_finished", "debug", _REQ + " pending_stores", "on_request_finished at the primary"),
    _spec("finish_ignored", "debug", _REQ + " known", "a repeated finish, or one for an unknown request"),
    _spec("call_rejected", "info", _REQ + " call reason", "a submit call refused with LifecycleError"),
    _spec("store_prepared", "debug", _REQ + " keys", "prepare_store: keys rows allocated, not ready"),
    _spec("store_rejected", "debug", _REQ + " keys", "prepare_store found no room"),
    _spec("store_completed", "debug", _REQ + " keys live stale success stored",
          "complete_store: live keys were still pending, stale ones were detached; stored became ready"),
    _spec("load_prepared", "debug", _REQ + " keys", "prepare_load pinned keys rows"),
    _spec("load_completed", "debug", _REQ + " keys", "complete_load unpinned keys rows"),
    _spec("promotion_allocated", "debug", _REQ + " job_id tier keys epoch", "rows allocated for a promotion"),
    _spec("cache_reset", "info", "", "the primary cleared its pool"),
    _spec("pool_events_dropped", "warning", "tier dropped_keys",
          "the pool's events not taken yet passed their bound: the oldest went (once per overflow)"),
    _spec("request_active_at_stop", "debug", _REQ + " finished pending_stores",
          "the roll call at stop: a request the primary still holds (not finalized)"),
    _spec("request_param_ignored", "warning", _REQ + " param reason",
          "a request's kv_transfer_params value ignored (or a kv_load_tiers entry skipped), as vLLM does"),
    _spec("cascades_dropped", "warning", "tier queued_bytes max_queued_bytes",
          "back-pressure: a tier's queued cascade bytes reached its bound; new cascades to it are dropped "
          "(once per episode)"),
    _spec("cascades_resumed", "info", "tier dropped", "back-pressure episode over: a cascade was accepted again"),
    _spec("cascade_skipped", "debug", _REQ + " tier reason",
          "a completed store's blocks not sent to a tier now (reason: admission, backpressure)"),
    _spec("cascade_admitted", "debug", _REQ + " tier reason",
          "blocks sent to a tier on behalf of a request other than by its store (reason: min_seen, write_back)"),
    # the supervisor
    _spec("request_finish_seen", "debug", _REQ, "the supervisor learned of the finish"),
    _spec("job_queued", "debug", _REQ + " kind job_id tier", "a job waits for a slot at its tier"),
    _spec("cascade_submitted", "debug", _REQ + " job_id tier", "a cascade job sent to its tier"),
    _spec("promotion_submitted", "debug", _REQ + " job_id tier", "a promotion job sent to its tier"),
    _spec("cascade_completed", "debug warning", _REQ + " job_id tier success", "a cascade job reported"),
    _spec("promotion_completed", "debug warning", _REQ + " job_id tier success", "a promotion job reported"),
    _spec("job_dropped", "info", _REQ + " kind job_id tier reason", "a job ended before reaching its tier"),
    _spec("job_timed_out", "warning", _REQ + " kind tier", "a store (kind=store, keys) or a job (job_id) expired"),
    _spec("late_report_ignored", "warning", "job_id tier", "a timed-out job's report: its rows are released"),
    _spec("job_report_unexpected", "warning", "job_id tier", "a report for no job of that tier"),
    _spec("lookup_timed_out", "warning", _REQ, "a secondary lookup past its deadline"),
    _spec("tier_stuck", "warning", "tier", "a tier owed answers and gave none for transfer_timeout_s"),
    _spec("tier_unstuck", "warning", "tier", "a tier known stuck answered again"),
    _spec("gather_timed_out", "warning", "what tiers", "a round through the tiers passed its deadline"),
    _spec("inline_call_demoted", "warning", "tier call", "an inline tier call blocked: it runs on the tier's thread"),
    _spec("tiers_not_shut_down", "warning", "tiers", "tiers that did not answer the stop's shutdown round"),
    _spec("promotions_backed_off", "info", "job_id tier keys backoff_s",
          "promotions of keys from a tier failed: that tier is not asked to promote them for backoff_s"),
    _spec("tier_finalized", "debug", _REQ + " tier", "the supervisor tells a tier the request is finished"),
    _spec("request_finalized", "debug", _REQ, "the request's state is gone"),
    _spec("cache_reset_draining", "info", "epoch", "the supervisor's part of reset_cache"),
    _spec("contract_violation", "warning error", "reason",
          "misuse rejected (warning) or the supervisor's guard (error, reason=submit_after_finalize)"),
    _spec("invariant_broken", "error", "", "a lifecycle counter went below zero"),
    # the tier actors
    _spec("tier_finish_received", "debug", _REQ + " tier", "a tier actor got on_request_finished"),
    _spec("tier_submit_received", "debug", _REQ + " tier job_id", "a tier actor got a submit"),
    _spec("tier_call_failed", "warning", "tier call", "a tier plugin's method raised"),
    _spec("job_report_invalid", "warning error", "tier",
          "a tier reported something that is not a JobResult (error, the tier actor), or a JobResult that does "
          "not fit its job (warning, the supervisor, with reason): every key of that job failed"),
    _spec("report_after_stop", "info", "tier job_id", "a tier reported after the stop"),
    # any actor
    _spec("actor_handler_failed", "error", "actor", "an actor's handler raised"),
)

_COMPONENT = tuple(
    _spec(name, levels, lifecycle=False)
    for name, levels in (
        ("tier_opened", "debug"), ("job_failed", "warning"), ("blocks_discarded", "warning"),
        ("unlink_failed", "warning"), ("files_unreadable", "warning"), ("events_dropped", "warning"),
        ("blocks_evicted", "info"), ("report_failed", "warning"), ("tier_degraded", "warning"),
        ("tier_recovered", "info"), ("lookup_failed", "warning error"),
        ("touch_failed", "debug"), ("evict_failed", "warning"), ("forget_failed", "warning"),
        ("engine_closed", "debug"), ("pool_not_pinned", "warning"), ("native_copier_unavailable", "warning"),
        ("copy_failed", "warning"),
        ("completion_failed", "warning"), ("interrupt_failed", "warning"),
        # MooncakeTier
        ("tier_connected", "info"), ("connect_failed", "warning debug"), ("calls_abandoned", "warning"),
        ("connections_left_open", "warning"),
        # the vLLM integration (stdlib logger kvactors.vllm)
        ("take_events_failed", "error"), ("transfer_failed", "warning"), ("transfer_plan_failed", "error"),
        ("transfer_wait_timed_out", "error"), ("block_identity", "info"), ("pool_reclaimed", "warning"),
        ("stats_failed", "error"), ("weights_fingerprinted", "info"), ("weights_fingerprint_failed", "warning"),
    )
)

#: Every event, by name.
EVENTS: dict[str, EventSpec] = {spec.name: spec for spec in (*_LIFECYCLE, *_COMPONENT)}
#: The names of the event log (the checker's input).
LIFECYCLE_EVENTS: frozenset[str] = frozenset(spec.name for spec in _LIFECYCLE)
#: The names of tiers' and the transfer engine's own events (stdlib only).
COMPONENT_EVENTS: frozenset[str] = frozenset(spec.name for spec in _COMPONENT)


class UnknownEventError(ValueError):
    """An event name not in this schema, or one missing a required field (strict mode only)."""


def problem(event_dict: Mapping[str, Any], *, lifecycle: bool) -> str | None:
    """What is wrong with ``event_dict`` against the schema, or ``None`` when nothing is."""
    name = event_dict.get("event")
    spec = EVENTS.get(name) if isinstance(name, str) else None
    if spec is None or spec.lifecycle != lifecycle:
        kind = "lifecycle" if lifecycle else "component"
        return f"event {name!r} is not a {kind} event of kvactors.log_schema"
    level = event_dict.get("level")
    if level is not None and level not in spec.levels:
        return f"event {name!r} logged at {level!r}, not at {'/'.join(sorted(spec.levels))}"
    missing = [f for f in sorted(spec.required) if f not in event_dict]
    if missing:
        return f"event {name!r} lacks field(s) {', '.join(missing)}"
    return None
