"""Fisher block of :class:`chainer.links.Linear`."""
from chainerkfac.curvature import kronecker


class LinearBlock(kronecker.KroneckerBlock):
    """``A ⊗ G`` for ``y = W x + b``.

    ``n_batch_axes > 1`` is handled like convolution positions: the extra
    batch axes of ``x`` count as ``T`` positions of one sample.
    """

    def input_rows(self, x):
        n = x.shape[0]
        d = self.link.W.shape[1]
        return x.reshape(-1, d), n

    def output_rows(self, gy):
        n = gy.shape[0]
        R = gy.reshape(-1, gy.shape[-1])
        return R, n, R.shape[0] // n
