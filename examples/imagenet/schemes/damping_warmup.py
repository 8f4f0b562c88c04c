"""Warmup damping (Osawa et al. §4.3).

The Fisher changes quickly during the first iterations, so training starts
with a large damping ε_0 and lowers it to the target ε over ``steps``
updates. The paper's exact rule did not survive in our copy; we interpolate
geometrically, which reaches the target exactly at step ``T = steps``::

    ε_t = ε_0 (ε / ε_0)^(t / T)   t < T
    ε_t = ε                       t >= T

(BatchNormalization blocks use a multiple of ε_t, set in the optimizer by
``bn_damping_multiplier``.)
"""
from chainer.training import extension


class DampingWarmup(extension.Extension):
    """Sets the optimizer's ``damping`` to ``ε_t`` every iteration.

    ``t`` is the number of updates done, so the first update uses ε_0. The
    value depends on the iteration alone, so the extension holds no state.

    Args:
        initial (float): ε_0.
        target (float): ε.
        steps (int): T.
        optimizer: Optimizer to edit; the updater's main one by default.
    """

    trigger = 1, 'iteration'
    priority = extension.PRIORITY_EDITOR

    def __init__(self, initial, target, steps, optimizer=None):
        if not (initial > 0 and target > 0 and steps >= 1):
            raise ValueError('warmup damping needs positive initial and '
                             'target values and steps >= 1')
        self.initial = initial
        self.target = target
        self.steps = steps
        self._optimizer = optimizer

    def value(self, iteration):
        """``ε_t`` for ``t = iteration``."""
        fraction = min(1.0, iteration / self.steps)
        return self.initial * (self.target / self.initial) ** fraction

    def initialize(self, trainer):
        self(trainer)

    def __call__(self, trainer):
        optimizer = self._optimizer or trainer.updater.get_optimizer('main')
        optimizer.damping = self.value(trainer.updater.iteration)
