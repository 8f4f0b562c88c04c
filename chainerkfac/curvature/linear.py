"""Fisher block of :class:`chainer.links.Linear`."""
from chainerkfac.curvature import kronecker


class LinearBlock(kronecker.KroneckerBlock):
    """``A ⊗ G`` for ``y = W x + b``.

    ``n_batch_axes > 1`` is handled like convolution positions: the extra
    batch axes of ``x`` count as ``T`` positions of one sample.
    """

    def input_columns(self, x):
        return x.reshape(-1, self.link.W.shape[1]).T, x.shape[0]

    def output_columns(self, gy):
        return gy.reshape(-1, gy.shape[-1]).T, gy.shape[0]
