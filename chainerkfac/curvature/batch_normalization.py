"""Fisher block of :class:`chainer.links.BatchNormalization` (paper §5.4).

Per sample ``i`` and channel ``c``, with ``x̂`` the normalised input and
``ĝ = n gy`` the per-sample output gradient::

    u_{i,c} = Σ_{h,w} ĝ_{i,c,h,w} x̂_{i,c,h,w}     (∂l_i/∂γ_c)
    v_{i,c} = Σ_{h,w} ĝ_{i,c,h,w}                 (∂l_i/∂β_c)

* ``bn_fisher='diagonal'`` (the paper's approximation, default):
  ``F = diag((1/n) Σ_i u_i², (1/n) Σ_i v_i²)``, inverted element-wise.
* ``bn_fisher='full'``: ``F = (1/n) Σ_i [u_i; v_i][u_i; v_i]ᵀ``, a
  ``2C x 2C`` block.

Damping is ``bn_damping_multiplier x damping`` with no π (the block is not
factored; :func:`chainerkfac.linalg.batch_norm_damping`); the inverse forms
are :mod:`chainerkfac.curvature.forms`'s ``Diagonal``, ``DenseInverse`` and
``DenseEigen``.
"""
from chainer import backend
import numpy

from chainerkfac import linalg
from chainerkfac.curvature import base
from chainerkfac.curvature import cost
from chainerkfac.curvature import families


class BatchNormalizationBlock(base.FisherBlock):
    """Diagonal or full Fisher of a BatchNormalization link's (γ, β)."""

    factors = ('F',)

    def __init__(self, link, name, options):
        super().__init__(link, name, options)
        self.bn_fisher = options.bn_fisher

    def form_family(self, options):
        return families.BATCH_NORM[options.bn_fisher, options.inverse]

    def params(self):
        return [p for p in (getattr(self.link, 'gamma', None),
                            getattr(self.link, 'beta', None)) if p is not None]

    def _reduce_axes(self, x):
        axis = self.link.axis
        if axis is None:
            axis = (0,) + tuple(range(2, x.ndim))
        if 0 not in axis:
            raise ValueError('{}: K-FAC needs the batch axis 0 among the '
                             'BatchNormalization axes, got {}'
                             .format(self.name, axis))
        return tuple(axis)

    def forward_statistics(self, x, wanted):
        if 'F' not in wanted:
            return None
        # Chainer retains x for its own backward: keeping it costs nothing.
        return x, self._reduce_axes(x)

    def backward_statistics(self, context, gy, node):
        x, axes = context
        xp = backend.get_array_module(gy)
        n = gy.shape[0]
        sample_axes = tuple(a for a in axes if a != 0)
        v = gy.sum(axis=sample_axes).reshape(n, -1)
        columns = []
        if getattr(self.link, 'gamma', None) is not None:
            # u = Σ gy x̂ = inv_std (Σ gy x - mean v): no x̂ is formed, and
            # the batch moments are the ones Chainer's forward computed.
            mean = getattr(node, 'mean', None)
            inv_std = getattr(node, 'inv_std', None)
            if mean is None or inv_std is None or mean.dtype != x.dtype:
                # A subclass's own function (e.g. BatchRenormalization),
                # or a half-precision forward's moments: the cancellation
                # in Σ gy x − mean v magnifies their rounding by
                # |mean| / std, so they are taken again in x's precision.
                mean = x.mean(axis=axes)
                inv_std = 1 / xp.sqrt(x.var(axis=axes) + self.link.eps)
            # Σ gy x in one pass: a batch-sized gy * x would be a fresh
            # allocation on every refresh, 4x slower than the sum itself.
            dims = 'abcdefghijklmnop'[:gy.ndim]
            kept = ''.join(d for a, d in enumerate(dims)
                           if a not in sample_axes)
            gx = xp.einsum('{0},{0}->{1}'.format(dims, kept), gy,
                           x).reshape(n, -1)
            columns.append((gx - mean.ravel() * v) * inv_std.ravel())
        if getattr(self.link, 'beta', None) is not None:
            columns.append(v)
        Z = xp.concatenate(columns, axis=1) * n
        if self.bn_fisher == 'diagonal':
            self._accumulate('F', (Z * Z).sum(axis=0), n)
        else:
            self._accumulate('F', Z.T @ Z, n)

    def gradient(self, weight_decay=0.0):
        if not self.shaped():
            return self.link.xp.zeros(0, dtype=numpy.float32)
        # γ and β are not decayed: their natural value is not zero.
        xp = backend.get_array_module(self.params()[0].grad)
        return xp.concatenate([linalg.widened(p.grad.ravel())
                               for p in self.params()])

    def set_gradient(self, grad):
        if not self.shaped():
            return
        offset = 0
        for p in self.params():
            p.grad[...] = grad[offset:offset + p.size].reshape(p.shape)
            offset += p.size

    def note_pass(self, x):
        self.pass_rows = x.size // x.shape[1]

    def cost(self):
        # The cost model counts channels and doubles them for (γ, β).
        return cost.BlockCost(self.name, self.bn_fisher,
                              (self.params()[0].size if self.shaped()
                               else 1,))

    def describe(self):
        if not self.shaped():
            return ('BN {} Fisher, shape set at first forward; no curvature '
                    'until then'.format(self.bn_fisher))
        size = self.params()[0].size * len(self.params())
        if self.bn_fisher == 'diagonal':
            return 'BN diagonal Fisher ({})'.format(size)
        return 'BN full Fisher {0}x{0}'.format(size)
