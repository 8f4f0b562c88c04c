"""Divergence that stays finite, and a bound that stalls training: noticed,
named, and told apart.

A loss can grow for hundreds of steps without a NaN.
:class:`DivergenceMonitor` watches, once per step:

* the training loss (when :meth:`KFAC.update
  <chainerkfac.optimizers.KFAC.update>` computes it): above
  :data:`LOSS_GROWTH` times the first loss it saw, the run diverges
  (:class:`DivergenceWarning`, or :class:`DivergenceError` with
  ``divergence='raise'``);
* the bound on the step's KL change (:mod:`chainerkfac.step_rule`): a
  scale ``ν`` below :data:`HARD_SCALE` on :data:`PATIENCE` consecutive
  steps means the bound, not the learning rate, sets every step, a
  thousand times shorter than asked; where the loss has not fallen below
  :data:`STALLED` times its first value the run stalls, and the
  :class:`StallWarning` says what helps: a larger ``kl_clip``.

Each kind of warning is given once. The monitor's state is part of the
optimizer's snapshot: a resumed run compares its losses with the same
first loss as the uninterrupted one.
"""
import math
import warnings

import chainer

from chainerkfac import step_rule

#: The loss counts as diverged above this multiple of the first loss.
LOSS_GROWTH = 10.0
#: A bound scale ``ν`` below this counts as a hard clip ...
HARD_SCALE = 1e-3
#: ... and this many hard clips in a row as the bound setting the step.
#: Healthy runs clip hard for a few steps where the first factors are far
#: from the later ones (``ν`` about 3e-3 for 15 steps on a ResNet-50 whose
#: factors are refreshed every 50 steps).
PATIENCE = 100
#: A loss still above this fraction of its first value after
#: :data:`PATIENCE` hard clips counts as stalled.
STALLED = 0.9


def serialize_loss(serializer, key, loss):
    """Saves or loads the loss ``loss`` under ``key`` and returns it (as
    loaded, when loading): one not seen yet (``None``) is kept as NaN."""
    value = float(serializer(key, math.nan if loss is None else loss))
    return None if math.isnan(value) else value


class DivergenceWarning(RuntimeWarning):
    """A K-FAC run shows a sign of divergence."""


class StallWarning(RuntimeWarning):
    """The bound on the KL change sets every step of a K-FAC run and its loss
    does not fall."""


class DivergenceError(RuntimeError):
    """A K-FAC run diverged (raised with ``divergence='raise'``)."""


class DivergenceMonitor:
    """Watches the loss and the bound's scale, step by step.

    Args:
        action (str): ``'warn'``: warn once; ``'raise'``: raise
            :class:`DivergenceError` at the first sign of divergence (a
            stall only warns).
    """

    def __init__(self, action, remedy=None):
        self.action = action
        #: What the divergence warning advises.
        self.remedy = remedy or (
            "lower the learning rate (under the default step_rule={!r} "
            "K-FAC's learning rate has MomentumSGD's units) or kl_clip, the "
            "bound on each step's KL change".format(step_rule.DEFAULT))
        self.first_loss = None
        self.last_loss = None
        self.hard_clips = 0
        self.warned = set()

    def observe(self, step, loss=None, update_scale=1.0):
        """Checks step ``step``'s loss (``None`` if unknown) and bound
        scale; warns or raises on a sign of divergence or of a stall."""
        if loss is not None and math.isfinite(loss):
            if self.first_loss is None:
                self.first_loss = loss
            self.last_loss = loss
            if loss > LOSS_GROWTH * abs(self.first_loss) > 0:
                self._diverges(step, (
                    'the training loss {:.4g} is over {:g} times the first '
                    'loss {:.4g}; {} (docs/guide/tuning.md)').format(
                        loss, LOSS_GROWTH, self.first_loss, self.remedy))
        self.hard_clips = self.hard_clips + 1 \
            if update_scale < HARD_SCALE else 0
        if self.hard_clips >= PATIENCE:
            self._bound_binds(step)

    #: The snapshot keys and the warning each flag stands for.
    _WARNED = (('warned_divergence', DivergenceWarning),
               ('warned_stall', StallWarning))

    def serialize(self, serializer):
        """Saves or loads the monitor's state (a loss not seen yet as
        NaN)."""
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        first = serialize_loss(serializer, 'first_loss', self.first_loss)
        last = serialize_loss(serializer, 'last_loss', self.last_loss)
        clips = int(serializer('hard_clips', self.hard_clips))
        warned = {category for key, category in self._WARNED
                  if bool(serializer(key, category in self.warned))}
        if loading:
            self.first_loss, self.last_loss = first, last
            self.hard_clips, self.warned = clips, warned

    def _diverges(self, step, what):
        message = 'K-FAC diverges at iteration {}: {}'.format(step, what)
        if self.action == 'raise':
            raise DivergenceError(message)
        self._warn(DivergenceWarning, message +
                   " (divergence='raise' stops the run)")

    def _bound_binds(self, step):
        if StallWarning in self.warned or (
                self.last_loss is not None
                and self.last_loss < STALLED * self.first_loss):
            return  # said once; or the loss falls: slow, not stuck
        clipped = ('the bound on the KL change scaled the last {} updates by '
                   'less than {:g}: its bound kl_clip, not the learning '
                   'rate, sets every step'.format(self.hard_clips,
                                                  HARD_SCALE))
        loss = 'the training loss is not known here' \
            if self.last_loss is None else \
            'the training loss {:.4g} has not fallen (first {:.4g})'.format(
                self.last_loss, self.first_loss)
        self._warn(StallWarning, (
            'K-FAC stalls at iteration {}: {}, and {}. Raise kl_clip '
            '(kl_clip=None turns the bound off); lowering the learning '
            'rate or kl_clip would shorten the steps further '
            '(docs/guide/tuning.md)').format(step, clipped, loss))

    def _warn(self, category, message):
        if category not in self.warned:
            self.warned.add(category)
            warnings.warn(message, category, stacklevel=4)
