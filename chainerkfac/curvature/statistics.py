"""A Fisher block's statistics between two steps (the first stage of
kfac-jax's statistics → cache → multiply): the sums of the per-sample terms
the link hooks compute, and their batch means when the optimizer takes them.
"""
from chainer import backend


class StatisticsSums:
    """The statistics of :class:`~chainerkfac.curvature.base.FisherBlock`
    (a mixin: it keeps ``_sum`` and ``_count`` per name of the block's
    ``factors``, which the block's ``__init__`` sets up, and reads its
    ``forward_factors``)."""

    def statistics_out(self, factor, shape, like):
        """The array a block writes the next statistics of ``factor`` into
        (with ``out=``) before :meth:`_accumulate` takes them.

        The first statistics of a step go straight into the block's sum,
        an array of ``shape`` kept from one refresh to the next: a new
        factor-sized array on every refresh is fresh memory, which on some
        machines costs more than the products written into it (see
        ``docs/guide/troubleshooting.md``). Later statistics of the same
        step (a link called twice) get a new array, which
        :meth:`_accumulate` adds. ``like`` gives the dtype and device.
        """
        total = self._sum[factor]
        if self._count[factor] or total is None or total.shape != shape \
                or total.dtype != like.dtype or \
                not total.flags.c_contiguous or \
                backend.get_device_from_array(total) != \
                backend.get_device_from_array(like):
            xp = backend.get_array_module(like)
            return xp.empty(shape, dtype=like.dtype)
        return total

    def _accumulate(self, factor, value, n_samples):
        """Adds a sum over ``n_samples`` per-sample terms to ``factor``."""
        if not self._count[factor]:
            self._sum[factor] = value
        elif value is not self._sum[factor]:
            self._sum[factor] += value
        self._count[factor] += n_samples

    def has_pending_statistics(self):
        """Whether statistics were collected since the last step."""
        return any(self._count.values())

    def discard_statistics(self):
        """Drops the statistics collected since the last step."""
        self._count = dict.fromkeys(self.factors, 0)

    def take_statistics(self, loss_scale=None):
        """Batch means of the statistics collected since the last step.

        ``loss_scale`` (see :meth:`gradient_loss_scale`) is divided out of
        the backward factors, which are quadratic in the output gradient.
        """
        stats = {}
        for f in self.factors:
            if self._count[f]:
                # In the block's sum, which the next statistics overwrite.
                mean = self._sum[f]
                mean /= self._count[f]
                if f not in self.forward_factors and loss_scale is not None:
                    mean /= loss_scale * loss_scale
                stats[f] = mean
        self.discard_statistics()
        return stats
