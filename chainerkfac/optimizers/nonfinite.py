"""Non-finite values in a step: checks, skipped steps and what they keep.

A step whose gradients hold NaN or Inf raises
:class:`~chainerkfac.curvature.NonFiniteError` naming the parameter, or,
with ``nonfinite='skip'``, is skipped; so is a float16 step whose
preconditioned gradient overflows under dynamic loss scaling. A skipped
step (or one that raises) leaves BatchNorm's running statistics as they
were (:func:`running_statistics`, :func:`restore`).
"""
import logging

import chainer.links as L
import numpy
from chainer import backend

from chainerkfac.curvature import base

logger = logging.getLogger(__name__)


class FiniteChecks:
    """The checks of :class:`~chainerkfac.optimizers.KFAC` (a mixin: it
    reads the optimizer's blocks, options and Chainer's loss scaling)."""

    def _count_skipped(self, taken):
        """Counts skipped steps in a row; raises after
        ``max_skipped_steps`` of them."""
        if taken:
            self._skipped_in_a_row = 0
            self._last_nonfinite = None
            return
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= self.max_skipped_steps:
            raise base.NonFiniteError(
                '{} steps in a row skipped up to iteration {} (the last '
                'non-finite gradient this process saw: {}); KFAC '
                'max_skipped_steps={}'.format(
                    self._skipped_in_a_row, self.t,
                    self._last_nonfinite or 'none, another process, the '
                    'or the loss scaling skipped',
                    self.max_skipped_steps))

    def serialize_checks(self, serializer):
        """Saves or loads what the checks carry from step to step: the
        count of steps skipped in a row, the last non-finite gradient's
        name and, under Chainer's dynamic loss scaling, the loss scale and
        whether a step ever overflowed (which sets how fast the scale
        grows back)."""
        count = int(serializer('skipped_in_a_row', self._skipped_in_a_row))
        name = str(serializer('last_nonfinite', self._last_nonfinite or ''))
        if self._loss_scaling_is_dynamic:
            # Chainer's Optimizer.serialize keeps neither.
            scale = float(serializer('loss_scale', self._loss_scale))
            overflowed = bool(serializer(
                'loss_scale_overflowed', self._loss_scaling_isnan_ever))
        self._skipped_in_a_row, self._last_nonfinite = count, name or None
        if self._loss_scaling_is_dynamic:
            self._loss_scale = scale
            self._loss_scaling_isnan_ever = overflowed

    def _preconditioned_fit(self):
        """Whether the preconditioned gradients of float16 parameters are
        finite.

        ``V = F̂⁻¹ ∇`` carries the loss scale ``s`` as ``∇`` does, and can
        be much larger than ``∇``: with a scale that just keeps ``∇``
        within float16 (dynamic loss scaling grows it up to there), ``s V``
        overflows. Dynamic loss scaling then skips the step and halves
        ``s``, as it does for an overflowing ``∇``; a static scale raises.
        The check is of ``s V`` as written into the gradients, before the
        bound's ``ν ≤ 1``: a step whose ``ν s V`` would have
        fitted is skipped too (conservative). Every process holds every
        preconditioned gradient after the gather, so all take the same
        decision.
        """
        halves = [(block.name, p.grad) for block in self.blocks
                  for p in block.params() if p.grad is not None
                  and p.grad.dtype == numpy.float16]
        if not halves:
            return True
        names = [name for (name, _), finite in zip(
            halves, all_finite([grad for _, grad in halves]))
            if not finite]
        if not names:
            return True
        if self._loss_scaling_is_dynamic:
            self._loss_scaling_isnan = self._loss_scaling_isnan_ever = True
            self._last_nonfinite = names[0]
            logger.warning('skipping iteration %d: the preconditioned '
                           'gradient of %s overflows float16 at loss scale '
                           '%g; halving the scale', self.t, names[0],
                           self._loss_scale)
            return False
        raise base.NonFiniteError(
            'the preconditioned gradient of {} overflows float16 at loss '
            'scale {:g} (iteration {}): lower the scale, use dynamic loss '
            'scaling (optimizer.loss_scaling()), or keep the parameters in '
            'float32 (chainer.mixed16)'.format(names[0], self._loss_scale or 1,
                                               self.t))

    def _check_finite_gradients(self):
        """False (skip) or an error when a gradient is NaN or Inf."""
        name, grad = first_nonfinite(
            (name, param.grad) for name, param in self.target.namedparams()
            if param.grad is not None)
        if name is None:
            return True
        if self.nonfinite == 'raise':
            # Chainer fills a gradient with NaN until a backward pass
            # writes it.
            unwritten = bool(backend.get_array_module(grad).isnan(
                grad).all())
            raise base.NonFiniteError(
                'non-finite gradient in {} at iteration {}{}; pass '
                "nonfinite='skip' to KFAC to skip such steps"
                .format(name, self.t, ' (NaN throughout: a NaN in the batch, '
                        'or a gradient no backward pass wrote, as before the '
                        'first loss.backward(); update(lossfun, *batch) runs '
                        'it)' if unwritten else ''))
        logger.warning('skipping iteration %d: non-finite gradient in %s',
                       self.t, name)
        self._last_nonfinite = name
        return False

    def _check_finite_momentum(self):
        """Refuses loaded momentum buffers with NaN or Inf, naming the
        parameter (the next step would blame its gradient)."""
        name, _ = first_nonfinite(
            (name, param.update_rule.state['v'])
            for name, param in self.target.namedparams()
            if param.update_rule is not None and param.update_rule.state
            and param.update_rule.state.get('v') is not None)
        if name is not None:
            raise ValueError('the snapshot holds a non-finite momentum of '
                             '{}'.format(name))


def first_nonfinite(named):
    """The first ``(name, array)`` of ``named`` holding NaN or Inf, or
    ``(None, None)`` (one transfer for all, :func:`all_finite`)."""
    named = list(named)
    flags = all_finite([array for _, array in named]) if named else []
    return next((pair for pair, finite in zip(named, flags) if not finite),
                (None, None))


def running_statistics(target):
    """Copies of BatchNorm running means and variances, to restore them
    when a step is skipped."""
    return [(array, array.copy())
            for link in target.links()
            if isinstance(link, L.BatchNormalization)
            and link.avg_mean is not None
            for array in (link.avg_mean, link.avg_var)]


def restore(running):
    """Puts back what :func:`running_statistics` copied."""
    for array, saved in running:
        array[...] = saved


def all_finite(arrays):
    """Whether each array is free of NaN and Inf, as a list of bools.

    The flags of arrays on one device come back in one transfer: on a GPU
    each read waits for the device, and ResNet-50 has 161 gradients.
    """
    if len({backend.get_device_from_array(a).name for a in arrays}) != 1:
        return [bool(backend.get_array_module(a).isfinite(a).all())
                for a in arrays]
    xp = backend.get_array_module(arrays[0])
    flags = xp.stack([xp.isfinite(a).all() for a in arrays])
    return backend.CpuDevice().send(flags).tolist()
