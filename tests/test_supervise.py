"""skymesh.runtime.supervise: a failing loop body is logged, counted and restarted; cancellation
stops it for good. Every wait is on an event; pytest-timeout only guards against hangs."""

from __future__ import annotations

import asyncio
import logging

import pytest

from skymesh.runtime.supervise import SupervisedLoop

pytestmark = pytest.mark.timeout(30)


class Restarts:
    """An on_restart hook that records its calls (stands in for a metrics counter)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, BaseException]] = []

    def __call__(self, name: str, exc: BaseException) -> None:
        self.calls.append((name, exc))


class RecordingSleep:
    """A backoff sleep that records the delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


async def test_a_raising_body_is_restarted_counted_and_keeps_working() -> None:
    restarts = Restarts()
    runs = 0
    work_done = 0
    worked = asyncio.Event()
    boom = RuntimeError("malformed metric")

    async def body() -> None:
        nonlocal runs, work_done
        runs += 1
        if runs == 1:
            raise boom
        while True:  # the loop's real work, after the restart
            work_done += 1
            if work_done == 5:
                worked.set()
            await asyncio.sleep(0)

    task = SupervisedLoop("probe", body, on_restart=restarts, backoff_s=0.0).start()
    assert task.get_name() == "probe"
    await worked.wait()
    assert runs == 2
    assert restarts.calls == [("probe", boom)]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert runs == 2 and len(restarts.calls) == 1  # cancellation is not a restart


async def test_cancel_while_running_stops_without_restart() -> None:
    restarts = Restarts()
    started = asyncio.Event()
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        started.set()
        await asyncio.Event().wait()  # forever

    task = asyncio.create_task(SupervisedLoop("idle", body, on_restart=restarts).run())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runs == 1 and restarts.calls == []


async def test_cancel_during_backoff_stops_without_restart() -> None:
    backing_off = asyncio.Event()
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        raise ValueError("bad")

    async def blocking_sleep(delay: float) -> None:
        backing_off.set()
        await asyncio.Event().wait()  # a backoff that outlasts the test

    loop = SupervisedLoop("failing", body, sleep=blocking_sleep)
    task = loop.start()
    await backing_off.wait()
    assert not loop.running and loop.failure_streak == 1 and loop.restarts == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runs == 1


async def test_cancellation_raised_by_the_body_propagates() -> None:
    async def body() -> None:
        raise asyncio.CancelledError

    restarts = Restarts()
    with pytest.raises(asyncio.CancelledError):
        await SupervisedLoop("cancelled", body, on_restart=restarts).run()
    assert restarts.calls == []


async def test_backoff_doubles_up_to_the_cap_and_resets_after_progress() -> None:
    sleep = RecordingSleep()
    runs = 0
    parked = asyncio.Event()

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs == 6:
            loop.mark_healthy()  # progress: the next failure starts a new streak
        if runs <= 7:
            raise OSError(f"failure {runs}")
        parked.set()
        await asyncio.Event().wait()

    loop = SupervisedLoop("dial", body, backoff_s=0.1, max_backoff_s=0.5, sleep=sleep)
    task = loop.start()
    await parked.wait()
    assert sleep.delays == [0.1, 0.2, 0.4, 0.5, 0.5, 0.1, 0.2]
    assert loop.restarts == 7 and loop.last_error == "OSError: failure 7"
    assert loop.running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_body_that_ran_healthily_starts_a_new_streak() -> None:
    sleep = RecordingSleep()
    runs = 0
    parked = asyncio.Event()

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise OSError("flaky")
        parked.set()
        await asyncio.Event().wait()

    # healthy_after_s=0: every run counts as a healthy stretch, so the backoff never grows
    loop = SupervisedLoop("flaky", body, backoff_s=0.1, healthy_after_s=0.0, sleep=sleep)
    task = loop.start()
    await parked.wait()
    assert sleep.delays == [0.1, 0.1, 0.1]
    assert loop.failure_streak == 0  # running past healthy_after_s
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_broken_hook_does_not_stop_the_restarts() -> None:
    runs = 0
    parked = asyncio.Event()

    def broken_hook(name: str, exc: BaseException) -> None:
        raise KeyError("no such counter")

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("first run fails")
        parked.set()
        await asyncio.Event().wait()

    task = SupervisedLoop("hooked", body, on_restart=broken_hook, backoff_s=0.0).start()
    await parked.wait()
    assert runs == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_body_that_returns_ends_the_supervision() -> None:
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1

    restarts = Restarts()
    await SupervisedLoop("one-shot", body, on_restart=restarts).run()
    assert runs == 1 and restarts.calls == []


async def test_failures_are_logged_with_structured_fields_and_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("skymesh.test_component")
    runs = 0
    parked = asyncio.Event()

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs <= 4:
            raise RuntimeError(f"failure {runs}")
        parked.set()
        await asyncio.Event().wait()

    restarts = Restarts()
    caplog.set_level(logging.ERROR, logger="skymesh.test_component")
    # an interval far longer than the test: only the first failure is logged
    loop = SupervisedLoop("noisy", body, on_restart=restarts, logger=logger, backoff_s=0.0,
                          log_interval_s=3600.0)
    task = loop.start()
    await parked.wait()
    records = [r for r in caplog.records if r.name == "skymesh.test_component"]
    assert len(records) == 1
    rec = records[0]
    assert rec.exc_info is not None and str(rec.exc_info[1]) == "failure 1"
    assert (rec.loop, rec.restarts, rec.failure_streak) == ("noisy", 1, 1)  # type: ignore[attr-defined]
    assert len(restarts.calls) == 4  # every failure is counted even when not logged
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_every_failure_is_logged_when_not_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("skymesh.test_component2")
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise RuntimeError(f"failure {runs}")

    caplog.set_level(logging.ERROR, logger="skymesh.test_component2")
    await SupervisedLoop("chatty", body, logger=logger, backoff_s=0.0, log_interval_s=0.0).run()
    records = [r for r in caplog.records if r.name == "skymesh.test_component2"]
    assert [str(r.exc_info[1]) for r in records if r.exc_info] == ["failure 1", "failure 2", "failure 3"]


def test_bad_backoff_bounds_are_rejected() -> None:
    async def body() -> None:
        return None

    with pytest.raises(ValueError):
        SupervisedLoop("x", body, backoff_s=2.0, max_backoff_s=1.0)
