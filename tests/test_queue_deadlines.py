"""The queue-wait deadline heap on its own (skymesh/routing/queue_deadlines.py)."""

from __future__ import annotations

from skymesh.routing.queue_deadlines import QueueDeadlines


def test_due_deadlines_come_out_soonest_first_and_only_once() -> None:
    deadlines = QueueDeadlines()
    deadlines.arm("b", 2.0)
    deadlines.arm("a", 1.0)
    deadlines.arm("c", 3.0)
    assert deadlines.due(0.5) == []
    assert deadlines.due(2.0) == [(1.0, "a"), (2.0, "b")]  # at the deadline counts
    assert deadlines.due(2.5) == [] and len(deadlines) == 1


def test_a_request_armed_again_keeps_both_entries_in_arming_order_on_a_tie() -> None:
    # a request queued again after a failed attempt gets a new deadline; the old entry
    # stays for the coordinator to skip (it compares the deadline it holds now)
    deadlines = QueueDeadlines()
    deadlines.arm("x", 5.0)
    deadlines.arm("y", 5.0)
    deadlines.arm("x", 9.0)
    assert deadlines.due(10.0) == [(5.0, "x"), (5.0, "y"), (9.0, "x")]
