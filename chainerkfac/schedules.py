"""When curvature is refreshed: stale-Fisher intervals (Osawa et al. §5.4).

An *interval* says how many optimizer steps a factor (or an inverse) may be
reused before it is recomputed. It is given as

* an ``int`` ``k``: refresh every ``k`` steps;
* a callable ``f(iteration) -> int`` (e.g. :class:`StaleFisher`);
* an :class:`Adaptive` policy that widens a factor's interval while its
  change rate ``‖X_t − X_{t−Δ}‖_F / ‖X_{t−Δ}‖_F`` stays below a threshold.

:class:`RefreshSchedule` holds the per-factor state (last refresh, current
interval) and is serialised with the optimizer.
"""
import math
import numbers


class StaleFisher:
    """The paper's schedule: fresh statistics at first, then a growing
    interval.

    The Fisher changes quickly during the first ~500 iterations and slowly
    afterwards (Osawa et al. §5.4, Fig. 5). The paper's exact per-epoch
    formula did not survive in our copy; this heuristic has the same shape::

        interval(t) = 1                                         t <= warmup
        interval(t) = min(max_interval,
                          1 + (t - warmup) // growth_period)    t >  warmup

    With ``growth_period`` set to the iterations of one epoch, the interval
    grows by one per epoch after the warm-up.
    """

    def __init__(self, warmup=500, growth_period=500, max_interval=20):
        for name, value in (('warmup', warmup),
                            ('growth_period', growth_period),
                            ('max_interval', max_interval)):
            if not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError('StaleFisher {} must be a non-negative int, '
                                 'got {!r}'.format(name, value))
        if growth_period == 0 or max_interval == 0:
            raise ValueError('StaleFisher growth_period and max_interval '
                             'must be positive')
        self.warmup = warmup
        self.growth_period = growth_period
        self.max_interval = max_interval

    def __call__(self, iteration):
        if iteration <= self.warmup:
            return 1
        return min(self.max_interval,
                   1 + (iteration - self.warmup) // self.growth_period)

    def __repr__(self):
        return 'StaleFisher(warmup={}, growth_period={}, max_interval={})'\
            .format(self.warmup, self.growth_period, self.max_interval)


class Adaptive:
    """Widen a factor's interval while it changes slowly.

    After every refresh of a factor its change rate ``r`` is measured. If
    ``r < threshold`` the interval is multiplied by ``growth`` (up to
    ``max_interval``), otherwise divided by it (down to ``min_interval``).
    """

    def __init__(self, threshold=0.05, min_interval=1, max_interval=50,
                 growth=2):
        if not threshold > 0:
            raise ValueError('Adaptive threshold must be positive, got {!r}'
                             .format(threshold))
        if not 1 <= min_interval <= max_interval:
            raise ValueError('Adaptive needs 1 <= min_interval <= '
                             'max_interval, got {} and {}'
                             .format(min_interval, max_interval))
        if not growth > 1:
            raise ValueError('Adaptive growth must be > 1, got {!r}'
                             .format(growth))
        self.threshold = threshold
        self.min_interval = int(min_interval)
        self.max_interval = int(max_interval)
        self.growth = growth

    def adapt(self, interval, change_rate):
        """Next interval after a refresh measured ``change_rate``."""
        if change_rate is None or not math.isfinite(change_rate):
            return interval
        if change_rate < self.threshold:
            return min(self.max_interval,
                       max(interval + 1, int(interval * self.growth)))
        return max(self.min_interval, int(interval / self.growth))

    def __repr__(self):
        return ('Adaptive(threshold={}, min_interval={}, max_interval={}, '
                'growth={})'.format(self.threshold, self.min_interval,
                                    self.max_interval, self.growth))


def check_interval(interval, what):
    """Validates an interval argument; returns it unchanged."""
    if isinstance(interval, bool):
        raise TypeError('{} must be an int, a callable or Adaptive, got {!r}'
                        .format(what, interval))
    if isinstance(interval, numbers.Integral):
        if interval < 1:
            raise ValueError('{} must be >= 1, got {}'.format(what, interval))
        return interval
    if isinstance(interval, Adaptive) or callable(interval):
        return interval
    raise TypeError('{} must be an int, a callable or Adaptive, got {!r}'
                    .format(what, interval))


class RefreshSchedule:
    """Per-factor refresh state: when it was last refreshed, and how often.

    ``due(step)`` is true at the first step and whenever at least the current
    interval has passed since the last refresh.
    """

    def __init__(self, interval):
        self.policy = interval
        self.last = None
        # Only Adaptive keeps a per-factor interval of its own.
        self.interval = (interval.min_interval
                         if isinstance(interval, Adaptive) else None)

    def current_interval(self, step):
        """The interval in force at iteration ``step``."""
        if isinstance(self.policy, numbers.Integral):
            return self.policy
        if isinstance(self.policy, Adaptive):
            return self.interval
        value = self.policy(step)
        if not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError('interval schedule {!r} returned {!r} at '
                             'iteration {}; expected an int >= 1'
                             .format(self.policy, value, step))
        return value

    def initial_interval(self):
        """The interval in force at the first iteration of a fresh run,
        whatever this schedule has adapted since."""
        if isinstance(self.policy, Adaptive):
            return self.policy.min_interval
        return self.current_interval(1)

    def due(self, step):
        """Whether the factor must be refreshed at iteration ``step``."""
        return self.last is None or step - self.last >= \
            self.current_interval(step)

    def mark(self, step, change_rate=None):
        """Records a refresh at ``step`` and adapts the interval."""
        self.last = step
        if isinstance(self.policy, Adaptive):
            self.interval = self.policy.adapt(self.interval, change_rate)

    def follow(self, step, interval):
        """Records a refresh another process made at ``step``, after which
        its schedule adapted to ``interval`` (ignored unless
        :class:`Adaptive`): every process then agrees on the next due step,
        however precisely the change rate would have travelled."""
        self.last = step
        if isinstance(self.policy, Adaptive):
            self.interval = int(interval)

    def serialize(self, serializer):
        """Saves or loads the last refresh and the adaptive interval.

        A snapshot taken with a fixed or scheduled interval holds no
        adaptive interval: loaded into an :class:`Adaptive` schedule, the
        interval starts again from ``min_interval``. A loaded interval is
        kept within this policy's ``min_interval`` and ``max_interval``."""
        last = serializer('last', -1 if self.last is None else self.last)
        self.last = None if int(last) < 0 else int(last)
        if self.interval is not None:
            try:
                loaded = int(serializer('interval', self.interval))
            except KeyError:
                loaded = self.policy.min_interval
            self.interval = min(max(loaded, self.policy.min_interval),
                                self.policy.max_interval)
