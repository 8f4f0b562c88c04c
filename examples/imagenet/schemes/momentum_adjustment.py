"""Momentum adjusted to the learning rate (Osawa et al. §4.4).

With the polynomial decay the learning rate shrinks quickly near the end, and
a fixed momentum would let the (larger) previous update dominate the current
one. The paper keeps the ratio between successive updates fixed; the original
implementation does it with::

    m_t = m_0 η_t / η_{t-1}   if η_t < η_{t-1}
    m_t = m_0                 otherwise

where η_t is the learning rate of update t and m_0 the configured momentum.
"""
from chainer.training import extension


class MomentumAdjustment(extension.Extension):
    """Sets the optimizer's ``momentum`` from the last two learning rates.

    It runs after every update, after the extensions that set the next
    learning rate (its priority is just below ``PRIORITY_EDITOR``), so it
    sees ``η_t`` of the coming update and remembers ``η_{t-1}``.

    Args:
        momentum (float): ``m_0``.
        optimizer: Optimizer to edit; the updater's main one by default.

    State (serialised): ``η_{t-1}`` and the momentum last set. A resumed run
    sets that momentum again before its first update, which reproduces the
    uninterrupted run when the snapshot was taken after this extension ran
    (Chainer's snapshot has the lowest priority, so it is).
    """

    trigger = 1, 'iteration'
    priority = extension.PRIORITY_EDITOR - 1

    def __init__(self, momentum, optimizer=None):
        self.initial = momentum
        self._optimizer = optimizer
        self.previous_lr = None
        self.momentum = momentum

    def _get_optimizer(self, trainer):
        return self._optimizer or trainer.updater.get_optimizer('main')

    def value(self, lr, previous_lr):
        """``m_t`` for ``η_t = lr`` and ``η_{t-1} = previous_lr``."""
        if lr < previous_lr:
            return self.initial * lr / previous_lr
        return self.initial

    def initialize(self, trainer):
        optimizer = self._get_optimizer(trainer)
        if self.previous_lr is None:
            self.previous_lr = optimizer.lr
        optimizer.momentum = self.momentum

    def __call__(self, trainer):
        optimizer = self._get_optimizer(trainer)
        self.momentum = self.value(optimizer.lr, self.previous_lr)
        self.previous_lr = optimizer.lr
        optimizer.momentum = self.momentum

    def serialize(self, serializer):
        previous_lr = serializer('previous_lr', self.previous_lr)
        self.previous_lr = None if previous_lr is None else float(previous_lr)
        self.momentum = float(serializer('momentum', self.momentum))
