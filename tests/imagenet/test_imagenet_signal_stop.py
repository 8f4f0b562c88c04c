"""Snapshot and stop all processes together on SIGTERM."""
import os
import signal

import pytest

from signal_stop import SignalStop


class FakeComm:
    """Sums over this process and ``others`` (the other processes' flags)."""

    def __init__(self, others=0):
        self.others = others
        self.calls = 0

    def allreduce_obj(self, value):
        self.calls += 1
        return value + self.others


class FakeUpdater:
    def __init__(self, iteration):
        self.iteration = iteration


class FakeTrainer:
    def __init__(self, iteration=0):
        self.updater = FakeUpdater(iteration)


@pytest.fixture
def restore_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_own_signal_snapshots_then_stops(restore_sigterm):
    comm = FakeComm()
    signals = SignalStop(comm)
    snapshot = signals.snapshot_trigger((100, 'iteration'))
    stop = signals.stop_trigger((1000, 'iteration'))
    assert not snapshot(FakeTrainer(1)) and not stop(FakeTrainer(1))
    os.kill(os.getpid(), signal.SIGTERM)
    assert not stop(FakeTrainer(2))  # only the snapshot trigger agrees
    assert snapshot(FakeTrainer(2)) and signals.stopped
    assert stop(FakeTrainer(2))
    assert comm.calls == 2  # one all-reduce per snapshot-trigger call


def test_another_process_signal(restore_sigterm):
    signals = SignalStop(FakeComm(others=1))
    assert signals.snapshot_trigger((100, 'iteration'))(FakeTrainer(1))
    assert signals.stop_trigger((1000, 'iteration'))(FakeTrainer(1))


def test_inner_triggers_still_fire(restore_sigterm):
    comm = FakeComm()
    signals = SignalStop(comm)
    snapshot = signals.snapshot_trigger((2, 'iteration'))
    stop = signals.stop_trigger((3, 'iteration'))
    assert [snapshot(FakeTrainer(i)) for i in (1, 2, 3, 4)] == [
        False, True, False, True]
    assert comm.calls == 4  # the all-reduce happens on every call
    assert stop(FakeTrainer(3)) and not signals.stopped
    assert stop.get_training_length() == (3, 'iteration')
