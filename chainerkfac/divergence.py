"""Divergence that stays finite: noticed, named, and stopped on request.

A run at too large a learning rate can stay finite for hundreds of steps
while its loss goes 2.3, 2.7, 232, 5e3, ... 8e6, which no NaN check sees.
:class:`DivergenceMonitor` watches two signs, once per step:

* the training loss (when :meth:`KFAC.update
  <chainerkfac.optimizers.KFAC.update>` computes it) rises above
  :data:`LOSS_GROWTH` times the first loss it saw;
* the update-norm guard (:mod:`chainerkfac.update_norm`) scaled the update
  by less than :data:`HARD_SCALE` on :data:`PATIENCE` consecutive steps:
  the learning rate asks for steps a thousand times longer than the bound
  allows, so the guard, not the learning rate, sets the step.

On the first sign it warns once (:class:`DivergenceWarning`) with what to
change; with ``divergence='raise'`` it raises :class:`DivergenceError`.
"""
import math
import warnings

#: The loss counts as diverged above this multiple of the first loss.
LOSS_GROWTH = 100.0
#: A guard scale ``ν`` below this counts as a hard clip ...
HARD_SCALE = 1e-3
#: ... and this many hard clips in a row as a sign of divergence. Healthy
#: runs clip hard for a few steps where the first factors are far from
#: the later ones (``ν`` about 3e-3 for 15 steps on a ResNet-50 whose
#: factors are refreshed every 50 steps).
PATIENCE = 100

_ADVICE = ('lower the learning rate, raise the damping, or lower kl_clip '
           '(docs/guide/tuning.md)')


class DivergenceWarning(RuntimeWarning):
    """A K-FAC run shows a sign of divergence."""


class DivergenceError(RuntimeError):
    """A K-FAC run diverged (raised with ``divergence='raise'``)."""


class DivergenceMonitor:
    """Watches the loss and the guard's scale, step by step.

    Args:
        action (str): ``'warn'``: warn once; ``'raise'``: raise
            :class:`DivergenceError` at the first sign.
    """

    def __init__(self, action):
        self.action = action
        self.first_loss = None
        self.hard_clips = 0
        self.warned = False

    def observe(self, step, loss=None, update_scale=1.0):
        """Checks step ``step``'s loss (``None`` if unknown) and guard
        scale; warns or raises on a sign of divergence."""
        sign = None
        if loss is not None and math.isfinite(loss):
            if self.first_loss is None:
                self.first_loss = loss
            elif loss > LOSS_GROWTH * abs(self.first_loss) > 0:
                sign = ('the training loss {:.4g} is over {:g} times the '
                        'first loss {:.4g}'.format(loss, LOSS_GROWTH,
                                                   self.first_loss))
        self.hard_clips = self.hard_clips + 1 \
            if update_scale < HARD_SCALE else 0
        if sign is None and self.hard_clips >= PATIENCE:
            sign = ('the update-norm guard scaled the last {} updates by '
                    'less than {:g}'.format(self.hard_clips, HARD_SCALE))
        if sign is None:
            return
        message = 'K-FAC diverges at iteration {}: {}; {}'.format(
            step, sign, _ADVICE)
        if self.action == 'raise':
            raise DivergenceError(message)
        if not self.warned:
            self.warned = True
            warnings.warn(message + " (divergence='raise' stops the run)",
                          DivergenceWarning, stacklevel=3)
