"""rose.worker.lifecycle: the state only moves forward, and a stop request is never undone by the loop's own moves
(a SIGTERM that lands while start-up ends still drains)."""

from __future__ import annotations

import math

import pytest

from rose.worker.lifecycle import Lifecycle, WorkerState


def test_a_stop_during_start_up_survives_the_start_up_ending():
    life = Lifecycle()
    assert life.state is WorkerState.STARTING and not life.started and life.drain_deadline == math.inf
    assert life.request_stop(drain_timeout=30)  # the first: a drain
    assert life.state is WorkerState.DRAINING and life.draining and not life.started
    assert life.advance(WorkerState.RUNNING)  # start-up done: the loop's phase moves on...
    assert life.started and life.state is WorkerState.DRAINING  # ...and the drain holds
    assert not life.should_exit(busy=True) and life.should_exit(busy=False)


def test_a_second_stop_request_stops_at_once_and_nothing_moves_back():
    life = Lifecycle()
    life.advance(WorkerState.RUNNING)
    assert life.state is WorkerState.RUNNING and not life.should_exit(busy=False)
    assert life.request_stop(drain_timeout=0.0) and not life.request_stop(drain_timeout=0.0)
    assert life.state is WorkerState.STOPPING and life.should_exit(busy=True)
    assert not life.advance(WorkerState.RUNNING)
    life.advance(WorkerState.STOPPING)
    life.advance(WorkerState.STOPPED)
    assert life.state is WorkerState.STOPPED
    with pytest.raises(ValueError, match="request_stop"):
        life.advance(WorkerState.DRAINING)


def test_a_burst_exit_is_stopping_without_draining():
    life = Lifecycle()
    life.advance(WorkerState.RUNNING)
    life.advance(WorkerState.STOPPING)  # the loop ended on its own (--burst, max_idle_time)
    assert life.state is WorkerState.STOPPING and not life.draining
