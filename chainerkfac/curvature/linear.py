"""Fisher block of :class:`chainer.links.Linear`."""
import dataclasses

from chainerkfac.curvature import base
from chainerkfac.curvature import doubly_factored
from chainerkfac.curvature import kronecker
from chainerkfac.curvature import low_rank


class LinearBlock(kronecker.KroneckerBlock):
    """``A ⊗ G`` for ``y = W x + b``.

    ``n_batch_axes > 1`` is handled like convolution positions: the extra
    batch axes of ``x`` count as ``T`` positions of one sample.
    """

    @classmethod
    def for_link(cls, link, options):
        """:class:`~chainerkfac.curvature.doubly_factored.DoublyFactoredBlock`
        for a Linear whose input is at least ``doubly_factored_from`` wide
        (known at setup: a lazily initialised link keeps this block), else
        this block."""
        threshold = options.doubly_factored_from
        if (threshold is not None and link.W.array is not None
                and link.W.shape[1] >= threshold):
            return doubly_factored.DoublyFactoredBlock
        return cls

    def __init__(self, link, name, options):
        super().__init__(link, name, options)
        #: The ``doubly_factored_from`` width a lazily initialised link
        #: could not be compared with at setup; its first input is.
        self.unsized_threshold = (options.doubly_factored_from
                                  if link.W.array is None else None)
        #: The step's rows, for the low-rank product
        #: (:mod:`chainerkfac.curvature.low_rank`).
        self.rows = low_rank.Rows()

    def cost(self):
        return dataclasses.replace(super().cost(), low_rank=True)

    def keeps_rows(self, x):
        W = self.link.W
        if self.form is None or not self.form.low_rank or W.array is None:
            return False
        return low_rank.pays(len(self.rows) + x.size // W.shape[1],
                             *self.dims())

    def keep_input(self, x):
        """Keeps a training pass's input rows; returns the pass's token for
        :meth:`keep_output_gradient`."""
        return self.rows.add_input(x.reshape(-1, self.link.W.shape[1]))

    def keep_output_gradient(self, token, gy):
        """Keeps the output gradient of the pass ``token``."""
        self.rows.add_gradient(token, gy.reshape(-1, gy.shape[-1]))

    def scale_rows(self, factor):
        self.rows.scale *= factor

    def clear_rows(self):
        self.rows.clear()

    def apply_form(self, grad):
        """The low-rank product where the step's rows are the whole
        gradient and it pays (:mod:`chainerkfac.curvature.low_rank`),
        else the form's dense one."""
        # Every kept pass passed keeps_rows: together they pay.
        rows = self.rows.take(self.has_bias)
        if (rows is not None and self.form.low_rank
                and low_rank.agrees(grad, *rows)):
            return self.form.apply_low_rank(*rows)
        return self.form.apply(grad)

    def forward_statistics(self, x, wanted):
        threshold, self.unsized_threshold = self.unsized_threshold, None
        width = self.link.W.shape[1]
        if threshold is not None and width >= threshold:
            base.fallback_logger.warning(
                'KFAC layer %s: its input is %d wide, at least '
                'doubly_factored_from=%d, but the link was initialised '
                'lazily, after setup chose its block: it keeps A ⊗ G (A '
                '%dx%d); give the Linear its input size for the '
                'doubly-factored block', self.name, width, threshold,
                *(width + int(self.has_bias),) * 2)
        return super().forward_statistics(x, wanted)

    def input_columns(self, x):
        return x.reshape(-1, self.link.W.shape[1]).T, x.shape[0]

    def output_columns(self, gy):
        return gy.reshape(-1, gy.shape[-1]).T, gy.shape[0]

    def input_position_sums(self, x):
        return _position_sums(x, self.link.W.shape[1])

    def output_position_sums(self, gy):
        return _position_sums(gy, gy.shape[-1])


def _position_sums(v, dim):
    """``(dim, n)``: the rows of ``v`` (``n`` samples of positions of
    length ``dim``) summed over each sample's positions."""
    return v.reshape(len(v), -1, dim).sum(axis=1).T, len(v)
