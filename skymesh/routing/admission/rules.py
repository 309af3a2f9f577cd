"""The admission list, the only place that orders the rules: a region checks a new request
against each, in this order, and the first refusal is the answer. A new rule is one file
in ``admission/`` plus one line here.

The queue's own bound (429 ``queue_full``) is not a rule of this list: it is the queue's
invariant, enforced by the enqueue itself (:meth:`BalancerCore.submit` raises
:class:`~skymesh.routing.dispatcher.QueueFull`) on every way into the queue, retries and
requests a peer bounced back included; a new request meets it after every rule here."""

from __future__ import annotations

from typing import Protocol

from skymesh.routing.admission.base import AdmissionRule
from skymesh.routing.admission.no_capacity import NoCapacityRule
from skymesh.routing.admission.queue_wait import QueueWaitRule
from skymesh.routing.admission.slo_unreachable import SloUnreachableRule


class AdmissionSettings(Protocol):
    """What building the list reads of the region's settings."""

    @property
    def max_queue_wait_s(self) -> float | None: ...

    @property
    def retry_after_s(self) -> float: ...

    @property
    def early_rejection(self) -> bool: ...


def admission_rules(settings: AdmissionSettings) -> tuple[AdmissionRule, ...]:
    """The rules ``settings`` switch on, in the order they are checked."""
    rules: list[AdmissionRule] = [NoCapacityRule(settings.retry_after_s)]
    if settings.max_queue_wait_s is not None:
        rules.append(QueueWaitRule(settings.max_queue_wait_s, settings.retry_after_s))
    if settings.early_rejection:
        rules.append(SloUnreachableRule(settings.retry_after_s))
    return tuple(rules)
