"""Polyak averaging: evaluate with an exponential average of the weights.

Ba, Grosse & Martens (ICLR 2017, §6): "An exponentially decayed Polyak
averaging (Polyak and Juditsky, 1992) is applied to the model parameters
(in addition to the means and the variances from batch normalization) for
all experiments". :class:`PolyakAveraging` keeps that
average beside the live model, whatever optimizer trains it (K-FAC or
MomentumSGD: it reads the weights after each step, nothing else);
:meth:`PolyakAveraging.averaged` swaps it in for evaluation and
:class:`AveragedEvaluator` is Chainer's ``Evaluator`` under it.
"""
import contextlib
import logging

import chainer.links as L
import numpy
from chainer import backend
from chainer.training import extension
from chainer.training import extensions

logger = logging.getLogger(__name__)


class PolyakAveraging(extension.Extension):
    """An exponential average of the parameters and BatchNorm statistics.

    After the ``t``-th step (``t = 1, 2, ...``), every parameter ``w`` of
    ``target`` and every BatchNormalization running mean and variance
    (``avg_mean``, ``avg_var``) has an average

    ``w̄_t = (1 - α_t) w̄_{t-1} + α_t w_t``, ``α_t = (1 - d) / (1 - dᵗ)``,

    which is the exponential average started at zero and divided by its
    bias, ``w̄_t = z_t / (1 - dᵗ)`` with ``z_t = d z_{t-1} + (1 - d) w_t``,
    ``z_0 = 0`` (Adam's correction, Kingma & Ba 2015 §3): the weights of
    the iterates ``w_1 ... w_t`` sum to one from the first step on, so
    early weights do not linger as they would in an average started at
    ``w_1`` (Ba et al. §6 state neither their decay nor their start).
    ``t`` counts the steps since the array was first seen (a lazily
    initialised parameter averages its own iterates only). Averages are
    kept in float32 or wider: a step ``α (w - w̄)`` would mostly round away
    in float16.

    As a trainer extension it folds in the weights after every iteration,
    before the evaluators run (its priority is above
    ``PRIORITY_WRITER``), and a ``Trainer`` snapshot stores the averages
    and the step count (:meth:`serialize`). In a manual loop, call
    :meth:`update` after each optimizer step.

    Under ``mpiexec``, ChainerMN's optimizer leaves each rank its own
    BatchNorm statistics (chainerkfac's averages them every step); with
    ``comm`` the averaged statistics are averaged over the ranks after each
    fold, one allreduce (the fold is linear: the average of the
    rank-averaged statistics). Every rank must then call :meth:`update`.

    Args:
        target (chainer.Link): The model whose parameters are averaged.
        decay (float): ``d`` in ``[0, 1)``, the weight of the old average;
            its time scale is about ``1 / (1 - d)`` steps. ``0`` keeps the
            last weights.
        comm: A ChainerMN communicator (``chainermn.create_communicator``
            or :func:`chainerkfac.create_communicator`), or ``None`` (one
            process, or ranks whose BatchNorm statistics are already
            equal).
    """

    trigger = 1, 'iteration'
    # Above the Evaluator's PRIORITY_WRITER: an evaluation at this
    # iteration sees the average of this iteration's weights.
    priority = extension.PRIORITY_WRITER + 1

    def __init__(self, target, decay=0.99, comm=None):
        if not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise ValueError('decay must be a number in [0, 1), got '
                             '{!r}'.format(decay))
        self.target = target
        self.decay = float(decay)
        self.comm = comm
        #: Steps folded into the average.
        self.count = 0
        self._averages = {}
        # Steps folded into each array's average (arrays seen late have
        # fewer).
        self._counts = {}

    def __call__(self, trainer):
        self.update()

    def _live(self):
        """``{name: live array}`` of what is averaged, read afresh each
        time: an array replaced since (a link moved to another device)
        is still the one found."""
        arrays = {name: param.array
                  for name, param in self.target.namedparams()
                  if param.array is not None}
        for name, link in self.target.namedlinks():
            if isinstance(link, L.BatchNormalization) \
                    and link.avg_mean is not None:
                arrays[name + '/avg_mean'] = link.avg_mean
                arrays[name + '/avg_var'] = link.avg_var
        return arrays

    def _averages_of(self, live):
        """The averages of ``live``, made (zero) for arrays seen first."""
        for name, array in live.items():
            if name not in self._averages:
                # A copy is on the array's device, which the current
                # device (where xp.zeros would allocate) need not be.
                average = array.astype(numpy.promote_types(
                    array.dtype, numpy.float32))
                average.fill(0)
                self._averages[name] = average
                self._counts[name] = 0
        return self._averages

    def update(self):
        """Folds the current weights into the average (one step)."""
        live = self._live()
        averages = self._averages_of(live)
        self.count += 1
        for name, array in live.items():
            self._counts[name] += 1
            alpha = (1 - self.decay) / (1 - self.decay ** self._counts[name])
            average = averages[name]
            average += alpha * (array.astype(average.dtype, copy=False)
                                - average)
        if self.comm is not None and self.comm.size > 1:
            self._share_statistics(live)

    def _share_statistics(self, live):
        statistics = [self._averages[name] for name in sorted(live)
                      if name.endswith(('/avg_mean', '/avg_var'))]
        if not statistics:
            return
        xp = backend.get_array_module(statistics[0])
        flat = xp.concatenate([s.ravel() for s in statistics])
        total = self.comm.allreduce(flat)
        offset = 0
        for s in statistics:
            s[...] = (total[offset:offset + s.size] / self.comm.size
                      ).reshape(s.shape)
            offset += s.size

    @contextlib.contextmanager
    def averaged(self):
        """A context in which ``target`` holds the averages.

        The live values are copied aside, the averages copied into the
        model's arrays (cast to their dtype), and the live values copied
        back on leaving, even on an exception: training resumes from
        exactly the weights and statistics it left. Raises
        ``RuntimeError`` before the first :meth:`update`.
        """
        if not self.count:
            raise RuntimeError('PolyakAveraging.averaged() before the first '
                               'update(): nothing has been averaged yet')
        live = self._live()
        saved = {name: array.copy() for name, array in live.items()}
        try:
            for name, array in live.items():
                array[...] = self._averages[name]
            yield
        finally:
            for name, array in live.items():
                array[...] = saved[name]

    def serialize(self, serializer):
        """Saves or loads the step counts and every average.

        Loading needs the model's parameters initialised (a ``Trainer``
        snapshot loads the model before its extensions), and resumes the
        average bit for bit. A snapshot written without the extension
        leaves the average to start afresh at the next step (said in the
        log)."""
        try:
            count = serializer('count', self.count)
        except KeyError:
            logger.warning('the snapshot holds no Polyak average: it starts '
                           'afresh from the next step')
            return
        self.count = int(count)
        averages = self._averages_of(self._live())
        for name in sorted(averages):
            key = name.lstrip('/')
            # In place: a deserializer copies into the array it is given.
            serializer['averages'](key, averages[name])
            self._counts[name] = int(serializer['counts'](
                key, self._counts[name]))


class AveragedEvaluator(extensions.Evaluator):
    """Chainer's ``Evaluator``, evaluating the model under its average.

    Its reports are named ``validation_averaged/...`` by default, beside
    a plain ``Evaluator``'s ``validation/...`` for the live model.

    Args:
        averaging (PolyakAveraging): The average to evaluate.

    The other arguments are those of
    ``chainer.training.extensions.Evaluator`` (the iterator, the target
    link, ...).
    """

    default_name = 'validation_averaged'

    def __init__(self, averaging, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.averaging = averaging

    def evaluate(self):
        """``Evaluator.evaluate`` within :meth:`PolyakAveraging.averaged`."""
        with self.averaging.averaged():
            return super().evaluate()


__all__ = ['PolyakAveraging', 'AveragedEvaluator']
