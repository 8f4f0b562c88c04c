"""Kronecker-factored block ``F ≈ A ⊗ G`` for layers ``s = W̄ ā``.

Conventions (the empirical Fisher of Martens & Grosse 2015; for
convolutions KFC, Grosse & Martens 2016, §3; Osawa et al. 2019, §3.2):
each
sample contributes rows ``ā_{i,t}`` (input patches with a homogeneous 1 when
the layer has a bias) and ``ĝ_{i,t} = n ∂L/∂s_{i,t}`` (the per-sample output
gradient of a batch-mean loss) for ``T`` positions ``t``::

    A = (1/n) Σ_i Σ_t ā_{i,t} ā_{i,t}ᵀ        (sum over positions)
    G = (1/(nT)) Σ_i Σ_t ĝ_{i,t} ĝ_{i,t}ᵀ     (mean over positions)

A Linear layer has ``T = 1``. Subclasses only turn inputs and output
gradients into columns (one per sample and position).

With ``batch_subsample = k > 1`` both sums run over the first ``m = ⌈n/k⌉``
samples of the batch only and divide by ``m`` instead of ``n``: the same
expectations, estimated from fewer samples, for about ``1/k`` of the
work.
``ĝ`` keeps the scale of the whole batch's mean loss.

With ``conv_factors='reduced'`` (Ba, Grosse & Martens 2017, appendix A) a
layer with ``T > 1`` positions takes one column per sample, the sum over
its positions scaled by ``T^(-1/2)``, for both factors::

    ã_i = T^(-1/2) Σ_t ā_{i,t}      g̃_i = T^(-1/2) Σ_t ĝ_{i,t}
    A = (1/n) Σ_i ã_i ã_iᵀ          G = (1/n) Σ_i g̃_i g̃_iᵀ

(the homogeneous coordinate of ``ã`` is ``√T``). With ``Ā``, ``D̄`` the
means over positions, ``A ⊗ G = |T|² E[Ā Āᵀ] ⊗ E[D̄ D̄ᵀ]``, their eq. (18):
the per-sample gradient ``Σ_t ā_t ⊗ ĝ_t`` taken as ``|T| Ā ⊗ D̄``. The
``T²`` is shared evenly so that each factor is KFC's where KFC's
assumptions hold: with activations constant over positions ``A`` is KFC's
``A``; with derivatives uncorrelated across positions (their cross terms
summing to zero over the batch) ``G`` is KFC's ``G``. Where the derivatives
are constant over positions too, the per-sample gradient is exactly ``T ā ⊗
ĝ`` and ``A ⊗ G`` is ``T`` times KFC's, which assumes them independent. The
statistics cost ``n d²`` instead of ``n T d²``. A Linear layer with one
position (``T = 1``) has the same factors in both modes.
"""
from chainer import backend
import numpy

from chainerkfac import linalg
from chainerkfac.curvature import base
from chainerkfac.curvature import cost
from chainerkfac.curvature import families
from chainerkfac.curvature import forms


def sample_chunks(n, dim, positions):
    """Slices of a batch of ``n`` samples whose ``Q Qᵀ`` are summed.

    A sample adds ``positions`` columns of length ``dim``. Each chunk holds
    about the fewest samples ``m`` with ``m T >= 4 d``: a product over that
    many columns is still a large ``syrk``, and adding up the ``d x d``
    products costs less than a quarter of them. Where samples have many
    positions (a convolution on a large input), the columns are then formed
    a few samples at a time instead of as one copy of the whole batch,
    which for a 1x1 convolution is no copy at all; otherwise the batch is
    one chunk.
    """
    m = max(1, -(-4 * dim // max(positions, 1)))
    m = -(-n // -(-n // m))  # even the chunks out
    return [slice(i, min(i + m, n)) for i in range(0, n, m)]


def _add(total, value):
    if total is None:
        return value
    total += value
    return total


class KroneckerBlock(base.FisherBlock):
    """A ``(A, G)`` block; ``∇W̄ = [W | b]`` as an ``(out, in)`` matrix."""

    factors = ('A', 'G')

    def __init__(self, link, name, options):
        super().__init__(link, name, options)
        self.has_bias = getattr(link, 'b', None) is not None
        self.batch_subsample = options.batch_subsample
        self.conv_factors = options.conv_factors

    def form_family(self, options):
        return families.KRONECKER[options.inverse]

    def _kept(self, batch):
        """The samples the statistics use: the first ``⌈n/k⌉``."""
        k = self.batch_subsample
        return batch if k == 1 else batch[:-(-len(batch) // k)]

    def _reduced(self, positions):
        """Whether the statistics of a sample with ``positions`` positions
        come from its sums over positions (``conv_factors='reduced'``)."""
        return self.conv_factors == 'reduced' and positions > 1

    def params(self):
        return [self.link.W] + ([self.link.b] if self.has_bias else [])

    def input_columns(self, x):
        """Returns ``(Q, n)``: input columns ``(d, n T)`` and the number of
        samples they stand for (the batch size; a fraction of it when only
        some positions are taken, which rescales ``A`` to all of them)."""
        raise NotImplementedError

    def input_positions(self, x):
        """The number of columns one sample of ``x`` adds in
        :meth:`input_columns` (``T``)."""
        W = self.link.W
        return x[0].size // (W.size // W.shape[0])

    def input_moments(self, x, sums, out=None):
        """Returns ``(Q Qᵀ, Q 1 or None, columns of Q, n)`` for the ``(Q,
        n)`` of :meth:`input_columns`; ``Q 1`` (the row sums, which the bias
        coordinate needs) only if ``sums``. ``Q Qᵀ`` is written into
        ``out`` if given."""
        W = self.link.W
        return self._moments(self.input_columns, x, W.size // W.shape[0],
                             self.input_positions(x), sums, out)

    def input_position_sums(self, x):
        """Returns ``(S, n)``: ``S`` of shape ``(d, n)``, each sample's
        input columns of :meth:`input_columns` summed over its positions
        (``Σ_t a_{i,t}``), and the number of samples."""
        raise NotImplementedError(
            "{} has no input_position_sums: conv_factors='reduced' needs it "
            'for a layer with several positions'.format(type(self).__name__))

    def reduced_input_moments(self, x, sums, out=None):
        """:meth:`input_moments` of the reduced factors: ``(S Sᵀ / T, S 1
        or None, n T, n)`` for the ``(S, n)`` of
        :meth:`input_position_sums`, the moments of the columns ``ã_i =
        S_i / √T`` with the homogeneous coordinate's ``Σ ã_i √T = S 1``
        and ``Σ T = n T`` in place of the column count."""
        W = self.link.W
        T = self.input_positions(x)
        gram, row_sums, count, n = self._moments(
            self.input_position_sums, x, W.size // W.shape[0], 1, sums, out)
        gram /= T
        return gram, row_sums, count * T, n

    @staticmethod
    def _moments(columns, batch, dim, positions, sums=False, out=None):
        """``Q Qᵀ`` (into ``out`` if given), ``Q 1`` if ``sums``, the number
        of columns and of samples of ``(Q, n) = columns(batch)``, summed
        over :func:`sample_chunks`."""
        gram = row_sums = None
        count = samples = 0
        # A GPU has the memory for the whole batch's columns, and each
        # product costs kernel launches: one product there.
        chunks = (sample_chunks(len(batch), dim, positions)
                  if backend.get_array_module(batch) is numpy
                  else [slice(0, len(batch))])
        for part in chunks:
            Q, n = columns(batch[part])
            xp = backend.get_array_module(Q)
            # Q @ Q.T of one buffer: BLAS syrk, half the flops of a GEMM.
            if gram is None:
                gram = xp.matmul(Q, Q.T, out=out)
            else:
                gram += Q @ Q.T
            if sums:
                row_sums = _add(row_sums, Q.sum(axis=1))
            count += Q.shape[1]
            samples += n
        return gram, row_sums, count, samples

    def output_columns(self, gy):
        """Returns ``(Q, n)``: output-gradient columns ``(out, n T)``."""
        raise NotImplementedError

    def output_position_sums(self, gy):
        """Returns ``(S, n)``: ``S`` of shape ``(out, n)``, each sample's
        output gradients summed over its positions."""
        raise NotImplementedError(
            "{} has no output_position_sums: conv_factors='reduced' needs "
            'it for a layer with several positions'.format(
                type(self).__name__))

    def forward_statistics(self, x, wanted):
        if 'A' in wanted:
            W = self.link.W
            d = W.size // W.shape[0]
            size = d + int(self.has_bias)
            A = self.statistics_out('A', (size, size), x)
            moments = (self.reduced_input_moments
                       if self._reduced(self.input_positions(x))
                       else self.input_moments)
            _, sums, columns, n = moments(
                self._kept(x), self.has_bias, out=A[:d, :d])
            if self.has_bias:
                A[:d, d] = A[d, :d] = sums
                A[d, d] = columns
            self._accumulate('A', A, n)
        return True if 'G' in wanted else None

    def backward_statistics(self, context, gy, node):
        n, out = len(gy), self.link.W.shape[0]
        T = gy[0].size // out
        gram = self.statistics_out('G', (out, out), gy)
        columns, positions = ((self.output_position_sums, 1)
                              if self._reduced(T) else
                              (self.output_columns, T))
        _, _, _, m = self._moments(columns, self._kept(gy), out, positions,
                                   out=gram)
        # ĝ = n gy per sample, n of the whole batch; the mean over positions
        # (or the T^(-1/2) of both reduced columns) divides by T.
        gram *= n * n / T
        self._accumulate('G', gram, m)

    def gradient(self, weight_decay=0.0):
        W = self.link.W
        if W.array is None:
            return self.link.xp.zeros((0, 0), dtype=numpy.float32)
        grad = linalg.widened(W.grad.reshape(W.shape[0], -1))
        if weight_decay:
            grad = grad + weight_decay * linalg.widened(
                W.array.reshape(grad.shape))
        if not self.has_bias:
            return grad
        xp = backend.get_array_module(grad)
        bias = linalg.widened(self.link.b.grad[:, None])
        return xp.concatenate([grad, bias], axis=1)

    def set_gradient(self, grad):
        W = self.link.W
        if W.array is None:
            return
        d = W.size // W.shape[0]
        W.grad[...] = grad[:, :d].reshape(W.shape)
        if self.has_bias:
            self.link.b.grad[...] = grad[:, d]

    def splittable(self):
        """Whether the family holds the forms whose rows or columns ranks
        can share (not the eigen form)."""
        return forms.KroneckerMixed in self.family.kinds and self.shaped()

    def dims(self):
        """``(d_A, d_G)``: the sizes of the factors (``d_A`` with the bias
        coordinate); ``(1, 1)``, the least a cost counts, before a lazily
        initialised link has a shape."""
        W = self.link.W
        if W.array is None:
            return 1, 1
        return W.size // W.shape[0] + int(self.has_bias), W.shape[0]

    def note_pass(self, x):
        self.pass_rows = len(x) * self.input_positions(x) \
            if self.link.W.array is not None else len(x)

    def cost(self):
        return cost.BlockCost(self.name, 'kronecker', self.dims())

    def describe(self):
        W = self.link.W
        if W.array is None:
            return ('K-FAC (A, G), shape set at first forward; no '
                    'curvature until then')
        d_in = W.size // W.shape[0] + int(self.has_bias)
        mode = (", conv_factors='reduced'" if self.conv_factors == 'reduced'
                else '')
        return 'K-FAC A {0}x{0}, G {1}x{1}{2}'.format(d_in, W.shape[0], mode)
