"""The doubly-factored Fisher block of a Linear whose input is a large
feature map (Ba, Grosse & Martens 2017 §4-4.1).

Ordering: this package writes a Kronecker product in the order of the
column-major ``vec`` of the gradient (``(A ⊗ G) vec ∇W̄ = vec(G ∇W̄ A)``,
:mod:`chainerkfac.curvature.kronecker`). A Linear flattens its input
``(n, C, H, W)`` channel by channel, so input ``c T + t`` is channel
``c`` at position ``t``, and the weights' block reads ``Ψ ⊗ K ⊗ G``
(channels, positions, outputs): the paper's ``K ⊗ Ψ ⊗ G`` for its ``T x
C`` activation matrix, with the two input axes the other way round.
"""
import math

from chainer import backend

from chainerkfac.curvature import cost
from chainerkfac.curvature import families
from chainerkfac.curvature import kronecker


def rank_one_factors(X):
    """``(k, ψ)``, of shapes ``(T, n)`` and ``(C, n)``: for each sample
    ``X_i`` of ``X`` (``n x C x T``, channels by positions) the best rank-1
    approximation ``X_i ≈ ψ_i k_iᵀ`` split evenly, ``ψ_i = √σ u`` and
    ``k_i = √σ v`` for its top singular triple ``(σ, u, v)`` (Ba, Grosse &
    Martens 2017 §4, Eq. 5, whose ``A = K Ψᵀ`` is this ``X_iᵀ``).

    The triple comes from the eigendecomposition of the smaller Gram
    matrix (``X_iᵀ X_i`` when ``T <= C``): ``v`` is its top eigenvector
    and ``√σ u = X_i v / √σ`` with ``σ = ‖X_i v‖``. The signs of ``u`` and
    ``v`` are arbitrary; only the outer products ``ψ ψᵀ`` and ``k kᵀ`` are
    used. A sample that is all zeros gives zeros; one with a NaN or Inf
    gives NaN, which the factors' non-finite checks then report.
    """
    n, C, T = X.shape
    if C < T:
        psi, k = rank_one_factors(X.transpose(0, 2, 1))
        return k, psi
    xp = backend.get_array_module(X)
    finite = xp.isfinite(X).all(axis=(1, 2))
    # LAPACK's eigh fails on a NaN where the standard block's products
    # would carry it into the factor: the sample is zeroed, then marked.
    X = xp.where(finite[:, None, None], X, 0)
    _, Q = xp.linalg.eigh(X.transpose(0, 2, 1) @ X)
    v = Q[:, :, -1]                                   # (n, T)
    Xv = (X @ v[:, :, None])[:, :, 0]                 # σ u, (n, C)
    root = xp.sqrt(xp.sqrt((Xv * Xv).sum(axis=1)))[:, None]   # √σ
    # Where σ = 0, X v = 0 too: dividing by 1 keeps ψ at 0.
    k, psi = v * root, Xv / xp.where(root > 0, root, 1)
    return tuple(xp.where(finite[:, None], f, xp.nan).T for f in (k, psi))


class DoublyFactoredBlock(kronecker.KroneckerBlock):
    """``Ψ ⊗ K ⊗ G`` for ``y = W x + b`` whose input ``x`` is a feature
    map of ``C`` channels at ``T`` positions (Ba, Grosse & Martens 2017 §4,
    Eq. 4-8; AlexNet's and VGG's first fully connected layers, whose ``A``
    would be ``C T x C T``).

    Each sample's input, a ``C x T`` matrix ``X_i``, is taken at its
    rank-1 approximation ``ψ_i k_iᵀ`` (:func:`rank_one_factors`), and the
    three factors are taken independent (Eq. 8)::

        Ψ = (1/n) Σ_i ψ_i ψ_iᵀ   (C x C)     K = (1/n) Σ_i k_i k_iᵀ   (T x T)
        G = (1/n) Σ_i ĝ_i ĝ_iᵀ   (out x out, the Linear block's)

    so that ``E[vec X vec Xᵀ] ≈ Ψ ⊗ K`` stands for the weights' ``A``
    (the module docstring gives the order). The bias has no homogeneous
    coordinate here: it gets a full block of its own, whose Fisher is
    ``G`` (§4). The inverse form
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
        # Before the base's __init__, which asks form_family for the forms.
        self.has_bias = getattr(link, 'b', None) is not None
        super().__init__(link, name, options)
        self.threshold = options.doubly_factored_from
        #: ``(C, T)``, from the first input (or a loaded ``Ψ`` and ``K``).
        self.layout = None

    def form_family(self, options):
        return families.doubly_factored(self.has_bias)

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
        """As every block's; a loaded ``Ψ`` and ``K`` also fix the layout,
        so that an input of another layout is refused by name."""
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

    def output_columns(self, gy):
        return gy.T, len(gy)

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
        return ('doubly-factored K-FAC Psi {0}x{0}, K {1}x{1}, G {2}x{2}{3}'
                .format(C, T, out, bias))
