"""Inverse forms: how a block's damped curvature is inverted and applied.

A block holds one form at a time, built from its factors when an inverse is
due and applied to every gradient until the next (kfac-jax's
statistics → cache → multiply; kfac-pytorch's inverse "methods")::

    form = Kind.refreshed(factors, damping)     the cache, once per refresh
    V    = form.apply(∇)                        the multiply, every step

The damping formulas are :mod:`chainerkfac.linalg`'s; a form only says
which one it applies. Kronecker blocks ``A ⊗ G`` (Martens & Grosse 2015
§6.3; Osawa et al. 2019 §3.1-3.2):

* :class:`KroneckerInverses`: ``A_d⁻¹``, ``G_d⁻¹`` (factored Tikhonov
  damping with π; ``V`` by two products);
* :class:`KroneckerCholesky`: the Cholesky factors of ``A_d`` and ``G_d``
  (triangular solves, for inverses that serve few steps;
  :func:`~chainerkfac.linalg.explicit_inverse_pays` chooses, in
  :func:`tikhonov_kind`);
* :class:`KroneckerMixed`: the smaller factor's inverse and the larger
  one's Cholesky factor (how ranks share a split block's preconditioning,
  :mod:`chainerkfac.distributed.split`);
* :class:`KroneckerEigen`: eigenbases with exact damping ``λ_G λ_Aᵀ + ε``
  (KAISA).

Doubly-factored blocks ``Ψ ⊗ K ⊗ G`` of a layer with a large feature-map
input (Ba, Grosse & Martens 2017 §4): :class:`DoublyFactoredInverses`.

Single matrices (BatchNorm blocks, Osawa et al. §5.4): :class:`Diagonal`
(element-wise), :class:`DenseInverse`, :class:`DenseEigen`.

Each form's arrays are stored in snapshots under its :attr:`~Form.keys`.
Which forms each kind of block may hold, and how a refresh builds one:
:mod:`chainerkfac.curvature.families`.
"""
from chainer import backend

from chainerkfac import linalg


class Form:
    """A damped inverse, ready to apply.

    Attributes:
        arrays (dict): The arrays :meth:`apply` needs, by :attr:`keys`.
        damping (float): The damping it was built with.
    """

    #: Names of the arrays (``'inverse_' + key`` in a snapshot).
    keys = ()

    def __init__(self, arrays, damping):
        self.arrays = arrays
        self.damping = damping

    @classmethod
    def matches(cls, keys):
        """Whether a snapshot holding arrays ``keys`` stored this form."""
        return set(keys) == set(cls.keys)

    def apply(self, grad):
        """``V = (F̂ + damping)⁻¹ grad``."""
        raise NotImplementedError

    #: Whether :meth:`apply_low_rank` exists (factored damping: ``F̂⁻¹``
    #: is a Kronecker product of two inverses).
    low_rank = False

    def apply_low_rank(self, left, right):
        """:meth:`apply` of the gradient ``leftᵀ right``
        (:mod:`chainerkfac.curvature.low_rank`), without forming it."""
        raise NotImplementedError

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.arrays.values())


# -- Kronecker blocks: two factors (A, G), the gradient a (d_G, d_A) matrix --

def _factored(A, G, damping, make):
    """``make(A, π √ε), make(G, √ε / π)``: factored Tikhonov damping."""
    damping_A, damping_G = linalg.factored_damping((A, G), damping)
    return make(A, damping_A), make(G, damping_G)


class _Sliceable(Form):
    """A Kronecker form with one array per factor (:meth:`sides`) whose
    parts give rows or columns of ``V`` (how ranks share a split block)."""

    def sides(self):
        """``(A's array, G's array)``."""
        raise NotImplementedError

    def with_sides(self, A_side, G_side):
        """The same kind of form with these arrays."""
        raise NotImplementedError

    def columns(self, start, stop):
        """The form whose :meth:`apply` gives columns ``start:stop`` of
        ``V``: ``G_d⁻¹ ∇W̄ A_d⁻¹[:, J]`` (``A`` must be inverted)."""
        A, G = self.sides()
        return self.with_sides(A[:, start:stop], G)

    def rows(self, start, stop):
        """The form whose :meth:`apply` gives rows ``start:stop`` of
        ``V``: ``G_d⁻¹[I, :] ∇W̄ A_d⁻¹`` (``G`` must be inverted)."""
        A, G = self.sides()
        return self.with_sides(A, G[start:stop])


class KroneckerInverses(_Sliceable):
    """``V = G_d⁻¹ ∇W̄ A_d⁻¹`` from explicit inverses."""

    keys = ('A_inv', 'G_inv')

    @classmethod
    def refreshed(cls, A, G, damping):
        A_inv, G_inv = _factored(A, G, damping, linalg.damped_inverse)
        return cls({'A_inv': A_inv, 'G_inv': G_inv}, damping)

    def apply(self, grad):
        return linalg.kronecker_precondition(grad, self.arrays['A_inv'],
                                             self.arrays['G_inv'])

    low_rank = True

    def apply_low_rank(self, left, right):
        return linalg.low_rank_precondition(
            left, right, self.arrays['A_inv'], self.arrays['G_inv'])

    def sides(self):
        """``(A_d⁻¹, G_d⁻¹)``."""
        return self.arrays['A_inv'], self.arrays['G_inv']

    @classmethod
    def from_sides(cls, A_side, G_side, damping=None):
        """The form of :meth:`sides` ``(A_side, G_side)``."""
        return cls({'A_inv': A_side, 'G_inv': G_side}, damping)

    def with_sides(self, A_side, G_side):
        return self.from_sides(A_side, G_side, self.damping)


class KroneckerCholesky(Form):
    """``V = G_d⁻¹ ∇W̄ A_d⁻¹`` by triangular solves with the Cholesky
    factors of ``A_d`` and ``G_d``."""

    keys = ('A_chol', 'G_chol')

    @classmethod
    def refreshed(cls, A, G, damping):
        A_chol, G_chol = _factored(A, G, damping, linalg.damped_cholesky)
        return cls({'A_chol': A_chol, 'G_chol': G_chol}, damping)

    def apply(self, grad):
        return linalg.cholesky_precondition(grad, self.arrays['A_chol'],
                                            self.arrays['G_chol'])

    low_rank = True

    def apply_low_rank(self, left, right):
        return linalg.cholesky_low_rank_precondition(
            left, right, self.arrays['A_chol'], self.arrays['G_chol'])


class KroneckerMixed(_Sliceable):
    """One factor's explicit inverse and the other's Cholesky factor
    (:func:`~chainerkfac.linalg.mixed_precondition`): rows or columns of
    ``V`` from rows or columns of the inverse alone.

    ``cholesky`` names the factor (``'A'`` or ``'G'``) kept as a Cholesky
    factor.
    """

    keys = ('A_inv', 'G_inv', 'A_chol', 'G_chol')

    def __init__(self, arrays, damping):
        super().__init__(arrays, damping)
        self.cholesky = 'A' if 'A_chol' in arrays else 'G'

    @classmethod
    def matches(cls, keys):
        return set(keys) in ({'A_inv', 'G_chol'}, {'A_chol', 'G_inv'})

    @classmethod
    def refreshed(cls, A, G, damping, cholesky, factorize=True):
        """With ``factorize=False`` the ``cholesky`` factor is left damped
        (``M + damping I``, under the key ``cholesky + '_chol'``) for
        whoever computes its Cholesky factor (:meth:`with_cholesky`)."""
        chol = linalg.damped_cholesky if factorize else linalg.damped_factor
        inv = linalg.damped_inverse
        damping_A, damping_G = linalg.factored_damping((A, G), damping)
        if cholesky == 'A':
            sides = chol(A, damping_A), inv(G, damping_G)
        else:
            sides = inv(A, damping_A), chol(G, damping_G)
        return cls.from_sides(*sides, cholesky, damping)

    def with_cholesky(self, L):
        """The form with ``L`` as the Cholesky factor."""
        A, G = self.sides()
        return self.with_sides(*((L, G) if self.cholesky == 'A'
                                 else (A, L)))

    @property
    def cholesky_factor(self):
        """The Cholesky factor (or, left to others, the damped factor)."""
        return self.arrays[self.cholesky + '_chol']

    def apply(self, grad):
        return linalg.mixed_precondition(grad, **self.arrays)

    def sides(self):
        """``(A's array, G's array)``: one inverse, one Cholesky factor."""
        return tuple(self.arrays[f + ('_chol' if f == self.cholesky
                                      else '_inv')] for f in 'AG')

    @classmethod
    def from_sides(cls, A_side, G_side, cholesky, damping=None):
        """The form of :meth:`sides` ``(A_side, G_side)``, ``cholesky``
        naming the factor kept as a Cholesky factor."""
        other = 'G' if cholesky == 'A' else 'A'
        sides = {'A': A_side, 'G': G_side}
        return cls({cholesky + '_chol': sides[cholesky],
                    other + '_inv': sides[other]}, damping)

    def with_sides(self, A_side, G_side):
        return self.from_sides(A_side, G_side, self.cholesky, self.damping)


class KroneckerEigen(Form):
    """``V = Q_G [(Q_Gᵀ ∇W̄ Q_A) / (λ_G λ_Aᵀ + ε)] Q_Aᵀ``: damping added
    exactly, to the eigenvalues of ``A ⊗ G``."""

    keys = ('A_eigvals', 'A_eigvecs', 'G_eigvals', 'G_eigvecs')

    @classmethod
    def refreshed(cls, A, G, damping):
        w_A, Q_A = linalg.symmetric_eigh(A)
        w_G, Q_G = linalg.symmetric_eigh(G)
        return cls({'A_eigvals': w_A, 'A_eigvecs': Q_A,
                    'G_eigvals': w_G, 'G_eigvecs': Q_G}, damping)

    def apply(self, grad):
        s = self.arrays
        return linalg.eigen_precondition(
            grad, (s['A_eigvals'], s['A_eigvecs']),
            (s['G_eigvals'], s['G_eigvecs']), self.damping)


def tikhonov_kind(dim_A, dim_G, reuse):
    """The factored-Tikhonov form of a Kronecker block whose inverse serves
    ``reuse`` steps: explicit inverses where they pay
    (:func:`~chainerkfac.linalg.explicit_inverse_pays`), else Cholesky
    factors."""
    if linalg.explicit_inverse_pays(dim_A, dim_G, reuse):
        return KroneckerInverses
    return KroneckerCholesky


# -- doubly-factored blocks: three factors (K, Ψ, G) and the bias's own ----

class DoublyFactoredInverses(Form):
    """``V_W = ∇W ×₁ G_d⁻¹ ×₂ Ψ_d⁻¹ ×₃ K_d⁻¹`` (along the output,
    channel and position axes) and ``v_b = (G + ε I)⁻¹ ∇b`` (Ba, Grosse &
    Martens 2017 §4, Eq. 9, with the factored damping of §4.1, Eq. 12):
    the gradient ``[∇W | ∇b]`` is an ``(out, C T)`` matrix, with one more
    column for a bias (whose full block ``G``, the Fisher of the bias
    alone, takes the whole damping ``ε``)."""

    keys = ('K_inv', 'Psi_inv', 'G_inv', 'bias_inv')

    @classmethod
    def matches(cls, keys):
        return set(keys) in (set(cls.keys), set(cls.keys[:3]))

    @classmethod
    def refreshed(cls, K, Psi, G, damping, bias=True):
        factors = K, Psi, G
        dampings = linalg.factored_damping(factors, damping)
        arrays = {key: linalg.damped_inverse(F, d) for key, F, d in
                  zip(('K_inv', 'Psi_inv', 'G_inv'), factors, dampings)}
        if bias:
            arrays['bias_inv'] = linalg.damped_inverse(G, damping)
        return cls(arrays, damping)

    def apply(self, grad):
        s = self.arrays
        weights = grad.shape[1] - ('bias_inv' in s)
        V = linalg.doubly_factored_product(
            grad[:, :weights], s['K_inv'], s['Psi_inv'], s['G_inv'])
        if 'bias_inv' not in s:
            return V
        xp = backend.get_array_module(grad)
        return xp.concatenate([V, s['bias_inv'] @ grad[:, weights:]], axis=1)


# -- single matrices: a BatchNorm block's (γ, β) ----------------------------

class Diagonal(Form):
    """``V = g / (f + ε)`` for a diagonal Fisher ``f``."""

    keys = ('diag_inv',)

    @classmethod
    def refreshed(cls, F, damping):
        return cls({'diag_inv': linalg.diagonal_inverse(F, damping)}, damping)

    def apply(self, grad):
        return grad * self.arrays['diag_inv']


class DenseInverse(Form):
    """``V = (F + ε I)⁻¹ g``."""

    keys = ('inv',)

    @classmethod
    def refreshed(cls, F, damping):
        return cls({'inv': linalg.damped_inverse(F, damping)}, damping)

    def apply(self, grad):
        return self.arrays['inv'] @ grad


class DenseEigen(Form):
    """``V = Q diag(1 / (λ + ε)) Qᵀ g``."""

    keys = ('eigvals', 'eigvecs')

    @classmethod
    def refreshed(cls, F, damping):
        w, Q = linalg.symmetric_eigh(F)
        return cls({'eigvals': w, 'eigvecs': Q}, damping)

    def apply(self, grad):
        return linalg.eigen_precondition_single(
            grad, (self.arrays['eigvals'], self.arrays['eigvecs']),
            self.damping)
