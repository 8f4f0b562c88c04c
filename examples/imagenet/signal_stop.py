"""Snapshot and stop every process at the same iteration on a signal.

Batch schedulers send SIGTERM before they kill a job. Raising an exception
from the handler would stop each process wherever it happens to be, possibly
inside a collective that the others then wait on forever. Instead the
handler only sets a flag. After every update, every process evaluates the
snapshot trigger, which combines the flags of all processes with one small
all-reduce; if any process was signalled, all of them write their snapshot
in that iteration, while the iterators still run, and the stop trigger ends
the loop before the next update.

Install it after the data loaders' server process has started (``train.py``
uses forkserver), so that no loader inherits the handler: a loader must die
of SIGTERM, which is how its pool terminates it.
"""
import signal

from chainer.training import trigger as trigger_module


class Either:
    """Trigger firing when ``condition()`` holds or ``trigger`` fires.

    ``condition`` is evaluated on every call, before ``trigger``.
    """

    def __init__(self, trigger, condition):
        self.trigger = trigger_module.get_trigger(trigger)
        self.condition = condition

    def __call__(self, trainer):
        return self.condition() or self.trigger(trainer)

    def get_training_length(self):
        return self.trigger.get_training_length()

    def serialize(self, serializer):
        self.trigger.serialize(serializer)


class SignalStop:
    """Catches signals; makes the snapshot and stop triggers that obey them.

    Args:
        comm: Communicator with ``allreduce_obj`` (ChainerMN's).
        signals: Signals to catch (SIGTERM by default).

    ``stopped`` tells whether a signal ended the run.
    """

    def __init__(self, comm, signals=(signal.SIGTERM,)):
        self.comm = comm
        self.received = False
        self.stopped = False
        for signum in signals:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def _agree(self):
        self.stopped = self.comm.allreduce_obj(int(self.received)) > 0
        return self.stopped

    def snapshot_trigger(self, trigger):
        """``trigger``, or a signal at any process (an all-reduce per call:
        give it to an extension that every process runs every iteration)."""
        return Either(trigger, self._agree)

    def stop_trigger(self, trigger):
        """``trigger``, or a signal agreed on by the snapshot trigger."""
        return Either(trigger, lambda: self.stopped)
