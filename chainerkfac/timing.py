"""Per-stage timers of K-FAC steps: a public hook for profiles.

Set a :class:`StageTimer` as the optimizer's ``stage_timer`` and every
step adds the wall time of each of its stages (the profile of Osawa et al.
2019, Fig. 6)::

    timer = chainerkfac.timing.StageTimer()
    optimizer.stage_timer = timer
    optimizer.update(lossfun, x, t)
    timer.coarse()   # {'forward': s, 'backward': s, 'statistics': s, ...}

Times are *exclusive*: the hooks' statistics inside the forward pass count
for ``statistics_forward`` only, a collective inside a refresh for
``communication`` only. The stages (:data:`STAGES`, finer names in
:data:`FINE`)::

    forward, backward      of ``update(lossfun, ...)`` (or the caller's,
                           timed with :meth:`StageTimer.enter`)
    statistics             the hooks on the forward and backward passes,
                           batch means and the exponential average
    communication          the K-FAC communicator's collectives (the
                           messages that carry no data, the ranks'
                           agreement on the step, as ``communication_control``)
    inversion              building inverse forms (and split blocks'
                           parts and shared factorizations)
    precondition           V = F̂⁻¹ ∇ and the step rule's sums
    update                 the rest of ``update``: checks, the update
                           rule, hooks

Without a timer (``stage_timer = None``, the default) a stage costs one
reused null context. ``calls['inversion']`` counts the steps that rebuilt
an inverse (under MPI with split blocks, every step: the exchange of
their parts is timed there) and ``calls['statistics_fold']`` those that
folded statistics.
"""
import collections
import contextlib
import time

#: The coarse stages, in step order.
STAGES = ('forward', 'backward', 'statistics', 'communication', 'inversion',
          'precondition', 'update')

#: Fine stage -> coarse stage, for the stages that have finer names.
FINE = {
    'statistics_forward': 'statistics',
    'statistics_backward': 'statistics',
    'statistics_fold': 'statistics',
    'communication_control': 'communication',
}

_UNTIMED = contextlib.nullcontext()


class StageTimer:
    """Exclusive wall time and calls per stage (see the module docstring).

    ``enter(name)`` / ``leave()`` nest; the time between two events goes to
    the innermost open stage. ``synchronize``, if given, is called before
    every reading of the clock, so that a GPU's queued work counts for the
    stage that queued it (at the price of the overlap of the host's kernel
    launches with the device's work). ``clock`` returns seconds.

    Attributes:
        totals (dict): Seconds per fine stage name.
        calls (collections.Counter): Entries per fine stage name.
    """

    def __init__(self, synchronize=None, clock=time.perf_counter):
        self._synchronize = synchronize
        self._clock = clock
        self.totals = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._stack = []
        self._since = None

    def _now(self):
        if self._synchronize is not None:
            self._synchronize()
        return self._clock()

    def enter(self, name):
        """Starts stage ``name`` (pausing the one it is nested in)."""
        now = self._now()
        if self._stack:
            self.totals[self._stack[-1]] += now - self._since
        self.calls[name] += 1
        self._stack.append(name)
        self._since = now

    def leave(self):
        """Ends the innermost stage."""
        now = self._now()
        self.totals[self._stack.pop()] += now - self._since
        self._since = now

    @contextlib.contextmanager
    def stage(self, name):
        """``enter(name)`` ... ``leave()`` as a context."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def reset(self):
        self.totals.clear()
        self.calls.clear()

    def coarse(self):
        """``{stage: seconds}`` over :data:`STAGES`."""
        out = dict.fromkeys(STAGES, 0.0)
        for name, value in self.totals.items():
            stage = FINE.get(name, name)
            out[stage if stage in out else 'update'] += value
        return out


def timed(timer, name):
    """``timer.stage(name)``, or a null context when ``timer`` is None."""
    return _UNTIMED if timer is None else timer.stage(name)
