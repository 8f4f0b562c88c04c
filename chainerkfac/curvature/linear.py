"""Fisher blocks of :class:`chainer.links.Linear`: the Kronecker block
``A ⊗ G``, and for a layer whose input is a large feature map the
doubly-factored block ``K ⊗ Ψ ⊗ G`` (Ba, Grosse & Martens 2017 §4)."""
import logging
import math

from chainer import backend

from chainerkfac import linalg
from chainerkfac.curvature import cost
from chainerkfac.curvature import forms
from chainerkfac.curvature import kronecker

#: Where a layer that falls back from the curvature it was asked for is
#: said (:mod:`chainerkfac.optimizers.kfac`'s ``fallback_logger``).
fallback_logger = logging.getLogger('chainerkfac.fallback')


class LinearBlock(kronecker.KroneckerBlock):
    """``A ⊗ G`` for ``y = W x + b``.

    ``n_batch_axes > 1`` is handled like convolution positions: the extra
    batch axes of ``x`` count as ``T`` positions of one sample.
    """

    @classmethod
    def for_link(cls, link, options):
        """:class:`DoublyFactoredBlock` for a Linear whose input is at
        least ``doubly_factored_from`` wide (known at setup: a lazily
        initialised link keeps this block), else this block."""
        threshold = options.doubly_factored_from
        if (threshold is not None and link.W.array is not None
                and link.W.shape[1] >= threshold):
            return DoublyFactoredBlock
        return cls

    def __init__(self, link, name, options):
        super().__init__(link, name, options)
        #: The ``doubly_factored_from`` width a lazily initialised link
        #: could not be compared with at setup; its first input is.
        self.unsized_threshold = (options.doubly_factored_from
                                  if link.W.array is None else None)

    def forward_statistics(self, x, wanted):
        threshold, self.unsized_threshold = self.unsized_threshold, None
        if threshold is not None and self.link.W.shape[1] >= threshold:
            fallback_logger.warning(
                'KFAC layer %s: its input is %d wide, at least '
                'doubly_factored_from=%d, but the link was initialised '
                'lazily, after setup chose its block: it keeps A ⊗ G (A '
                '%dx%d); give the Linear its input size for the '
                'doubly-factored block', self.name, self.link.W.shape[1],
                threshold, self.link.W.shape[1] + int(self.has_bias),
                self.link.W.shape[1] + int(self.has_bias))
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


def rank_one_factors(X):
    """``(k, ψ)``, of shapes ``(T, n)`` and ``(C, n)``: for each sample
    ``X_i`` of ``X`` (``n x C x T``) the best rank-1 approximation ``X_i ≈
    ψ_i k_iᵀ`` split evenly, ``ψ_i = √σ u``, ``k_i = √σ v`` for its top
    singular triple ``(σ, u, v)`` (Ba, Grosse & Martens 2017 §4, Eq. 5).

    The triple comes from the eigendecomposition of the smaller Gram
    matrix (``X_iᵀ X_i`` when ``T <= C``): ``σ² = λ_max``, ``v`` its
    eigenvector and ``√σ u = X_i v / √σ``. The signs of ``u`` and ``v``
    are arbitrary; only the outer products ``ψ ψᵀ`` and ``k kᵀ`` are used.
    A sample that is all zeros gives zeros.
    """
    n, C, T = X.shape
    if C < T:
        psi, k = rank_one_factors(X.transpose(0, 2, 1))
        return k, psi
    xp = backend.get_array_module(X)
    _, Q = xp.linalg.eigh(X.transpose(0, 2, 1) @ X)
    v = Q[:, :, -1]                                   # (n, T)
    Xv = (X @ v[:, :, None])[:, :, 0]                 # σ u, (n, C)
    root = xp.sqrt(xp.sqrt((Xv * Xv).sum(axis=1)))    # √‖X v‖ = √σ
    # Where σ = 0, X v = 0 too: dividing by 1 keeps ψ at 0.
    return (v * root[:, None]).T, (Xv / xp.where(root > 0, root, 1)[:, None]).T


class DoublyFactoredBlock(LinearBlock):
    """``K ⊗ Ψ ⊗ G`` for ``y = W x + b`` whose input ``x`` is a feature
    map of ``C`` channels at ``T`` positions (Ba, Grosse & Martens 2017 §4,
    Eq. 4-8; AlexNet's and VGG's first fully connected layers, whose ``A``
    would be ``C T x C T``).

    Each sample's input, a ``C x T`` matrix ``X_i`` (``Linear`` flattens
    ``x`` channel by channel), is taken at its rank-1 approximation ``ψ_i
    k_iᵀ`` (:func:`rank_one_factors`), and the three factors are taken
    independent::

        K = (1/n) Σ_i k_i k_iᵀ   (T x T)     Ψ = (1/n) Σ_i ψ_i ψ_iᵀ   (C x C)
        G = (1/n) Σ_i ĝ_i ĝ_iᵀ   (out x out, as :class:`LinearBlock`'s)

    so that ``E[vec X vec Xᵀ] ≈ K ⊗ Ψ`` stands for the weights' ``A``. The
    bias has no homogeneous coordinate here: it gets a full block of its
    own, whose Fisher is ``G``. The inverse form
    (:class:`~chainerkfac.curvature.forms.DoublyFactoredInverses`)
    shares the damping between the three factors by Eq. 12's π's and
    damps the bias's block by the whole damping.

    The layout ``(C, T)`` comes from the first input, which must arrive as
    the feature map itself (``(n, C, H, W)``, or ``(n, C, T)``), not
    flattened; it costs ``T³ + C³ + 2 out³`` to invert, against ``(C T)³ +
    out³`` for ``A ⊗ G``.
    """

    factors = ('K', 'Psi', 'G')
    forward_factors = ('K', 'Psi')

    def __init__(self, link, name, options):
        super().__init__(link, name, options)
        self.threshold = options.doubly_factored_from
        #: ``(C, T)``, from the first input.
        self.layout = None

    def form_family(self, options):
        return forms.doubly_factored(getattr(self.link, 'b', None)
                                     is not None)

    def feature_map(self, x):
        """``x`` as ``(n, C, T)``, fixing :attr:`layout` at the first
        input; a ``ValueError`` names the layer for an input that is not
        the feature map the layer flattens, or whose layout changed."""
        width = self.link.W.shape[1]
        if x.ndim < 3 or x[0].size != width:
            raise ValueError(
                'KFAC layer {}: a Linear with an input {} wide '
                '(doubly_factored_from={}) gets the doubly-factored block, '
                'which needs the input as the feature map the link '
                'flattens, (n, C, H, W), but got shape {}: pass the feature '
                'map unflattened, or set doubly_factored_from to None (or '
                'above {}) for the standard block'.format(
                    self.name, width, self.threshold, tuple(x.shape), width))
        layout = x.shape[1], x[0].size // x.shape[1]
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise ValueError(
                'KFAC layer {}: the doubly-factored block took its input as '
                '{} channels at {} positions, and now gets shape {}'.format(
                    self.name, *self.layout, tuple(x.shape)))
        return x.reshape(len(x), *layout)

    def shapes_known(self):
        return self.layout is not None

    def serialize(self, serializer):
        """As every block's; a loaded ``K`` and ``Ψ`` also fix the
        layout, so that an input of another layout is refused by name."""
        super().serialize(serializer)
        K, Psi = self.factor['K'], self.factor['Psi']
        if K is not None and Psi is not None:
            self.layout = len(Psi), len(K)

    def forward_statistics(self, x, wanted):
        due = [f for f in self.forward_factors if f in wanted]
        if due:
            kept = self._kept(self.feature_map(x))
            columns = dict(zip(self.forward_factors,
                               rank_one_factors(kept)))
            xp = backend.get_array_module(kept)
            for f in due:
                Q = columns[f]
                out = self.statistics_out(f, (len(Q), len(Q)), Q)
                self._accumulate(f, xp.matmul(Q, Q.T, out=out), len(kept))
        return True if 'G' in wanted else None

    def curvature_inner(self, grad, damping):
        """``⟨∇W, (K ⊗ Ψ ⊗ G) ∇W⟩ + ⟨∇b, G ∇b⟩ + λ ‖∇‖²``."""
        xp = backend.get_array_module(grad)
        weights = grad[:, :self.link.W.shape[1]]
        product = linalg.doubly_factored_product(
            weights, self.factor['K'], self.factor['Psi'], self.factor['G'])
        total = xp.vdot(product.ravel(), weights.ravel())
        if self.has_bias:
            bias = grad[:, -1]
            total = total + xp.vdot(bias, self.factor['G'] @ bias)
        return total + damping * xp.vdot(grad.ravel(), grad.ravel())

    def splittable(self):
        return False

    def dims(self):
        """``(T, C, out)``; before the first input, the input's width
        taken as a square ``C = T`` (for a cost, never used to compute)."""
        d_in, out = self.link.W.shape[1], self.link.W.shape[0]
        if self.layout is None:
            side = math.isqrt(d_in) or 1
            return side, side, out
        C, T = self.layout
        return T, C, out

    def cost(self):
        return cost.BlockCost(self.name, 'doubly_factored', self.dims())

    def describe(self):
        out = self.link.W.shape[0]
        bias = ', bias block {0}x{0}'.format(out) if self.has_bias else ''
        if self.layout is None:
            return ('doubly-factored K-FAC (input {} wide), layout set at '
                    'first forward; no curvature until then'.format(
                        self.link.W.shape[1]))
        C, T = self.layout
        return ('doubly-factored K-FAC K {0}x{0}, Psi {1}x{1}, G {2}x{2}{3}'
                .format(T, C, out, bias))
