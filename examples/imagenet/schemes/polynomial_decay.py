"""Polynomial learning-rate decay (Osawa et al. §4.4).

With ``e`` the fractional epoch::

    η(e) = η_0                                           e < e_start
    η(e) = η_0 (1 - (e - e_start) / (e_end - e_start))^p  e_start <= e < e_end
    η(e) = 0                                             e >= e_end

The published configurations put ``e_end`` after the last epoch, so the rate
never reaches 0 during training.
"""
from chainer.training import extension


class PolynomialDecay(extension.Extension):
    """Sets the optimizer's ``lr`` to ``η(epoch_detail)`` every iteration.

    The rate for the next update is set after each update and, through
    :meth:`initialize`, before the first one (also after a resume, so the
    extension holds no state).

    Args:
        initial (float): ``η_0``.
        start, end (float): ``e_start`` and ``e_end`` (epochs).
        power (float): ``p``.
        optimizer: Optimizer to edit; the updater's main one by default.
    """

    trigger = 1, 'iteration'
    priority = extension.PRIORITY_EDITOR

    def __init__(self, initial, start, end, power, optimizer=None):
        if not end > start:
            raise ValueError('decay end {} must come after its start {}'
                             .format(end, start))
        self.initial = initial
        self.start = start
        self.end = end
        self.power = power
        self._optimizer = optimizer

    def value(self, epoch):
        """``η(epoch)``."""
        if epoch < self.start:
            return self.initial
        progress = min(1.0, (epoch - self.start) / (self.end - self.start))
        return self.initial * (1.0 - progress) ** self.power

    def initialize(self, trainer):
        self(trainer)

    def __call__(self, trainer):
        optimizer = self._optimizer or trainer.updater.get_optimizer('main')
        optimizer.lr = self.value(trainer.updater.epoch_detail)
