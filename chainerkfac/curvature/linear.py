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

    def input_position_sums(self, x):
        return _position_sums(x, self.link.W.shape[1])

    def output_position_sums(self, gy):
        return _position_sums(gy, gy.shape[-1])


def _position_sums(v, dim):
    """``(dim, n)``: the rows of ``v`` (``n`` samples of positions of
    length ``dim``) summed over each sample's positions."""
    return v.reshape(len(v), -1, dim).sum(axis=1).T, len(v)
