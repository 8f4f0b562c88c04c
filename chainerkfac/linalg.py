"""Damped inverses and preconditioning: the damping formulas, and which
block gets which damping, live here only.

Notation (Martens & Grosse 2015 §6.3; Osawa et al. CVPR 2019 §3.1-3.2): a
layer's Fisher block is approximated by ``A ⊗ G``; ``∇W̄`` is its gradient
as an ``(out, in)`` matrix (bias in the last column); ``ε`` is the damping.

* Factored Tikhonov damping (``inverse='cholesky'``)::

      π   = sqrt( (tr A / dim A) / (tr G / dim G) )
      A_d = A + π √ε I,    G_d = G + (√ε / π) I,    V = G_d⁻¹ ∇W̄ A_d⁻¹

  ``V`` comes from explicit inverses (matrix products) or from the Cholesky
  factors of ``A_d`` and ``G_d`` (triangular solves), whichever is cheaper
  for the block's shape and how long the inverse is reused
  (:func:`explicit_inverse_pays`).

* The doubly-factored approximation ``A ≈ Ψ ⊗ K`` (channels,
  positions) of a layer with a large feature-map input (Ba, Grosse &
  Martens 2017 §4-4.1): the damping shared by three factors, ``π_i
  ε^(1/3)`` each (:func:`factored_damping`), and the bias in a block of
  its own damped by ``ε``; with ``∇W`` as an ``(out, C, T)`` tensor and
  ``×ₙ`` the product along its ``n``-th axis
  (:func:`doubly_factored_product`)::

      V_W = ∇W ×₁ G_d⁻¹ ×₂ Ψ_d⁻¹ ×₃ K_d⁻¹,   v_b = (G + ε I)⁻¹ ∇b

* Exact damping in the eigenbasis (``inverse='eigen'``, KAISA)::

      A = Q_A diag(λ_A) Q_Aᵀ,  G = Q_G diag(λ_G) Q_Gᵀ
      V = Q_G [ (Q_Gᵀ ∇W̄ Q_A) / (λ_G λ_Aᵀ + ε) ] Q_Aᵀ

* A single damped matrix (BatchNorm blocks): ``(F + ε I)⁻¹``, element-wise
  for a diagonal ``F``.

The damping ``ε`` of a block (:func:`layer_damping`,
:func:`batch_norm_damping`): a Linear or Convolution2D block takes the
``damping`` option plus the curvature ``η`` of the L2 weight decay its
weights get (Osawa et al. §4.2); a BatchNorm block ``bn_damping_multiplier``
times the damping (γ and β are not decayed).

Everything takes and returns arrays of the caller's array module (NumPy or
CuPy); the LAPACK fast path for CPU inverses is small and guarded.
"""
import math

import numpy
from chainer import backend

# A damped factor that still fails Cholesky (round-off, damping 0) is retried
# with jitter of _JITTER_START * mean(diag) growing tenfold per try, then
# inverted through a clipped eigendecomposition.
_JITTER_START = 1e-7
_JITTER_TRIES = 6


def widened(array):
    """``array`` in the precision K-FAC computes in: float16 becomes
    float32, any other dtype stays. Statistics, factors, inverses and the
    preconditioned gradient of a float16 (or mixed16) model are float32:
    a convolution's bias entry of ``A`` sums ``n T`` ones (over float16's
    65,504 at batch 64 on 32x32 positions), and squares of loss-scaled
    gradients overflow float16; in float32 the loss scale ``s`` can be
    divided out of the summed squares (by ``s²``, exact)."""
    dtype = working_dtype(array.dtype)
    return array if array.dtype == dtype else array.astype(dtype)


def working_dtype(dtype):
    """The dtype :func:`widened` gives arrays of ``dtype``."""
    return numpy.dtype(numpy.float32 if dtype == numpy.float16 else dtype)


def layer_damping(hyperparam):
    """``ε + η``: the damping of a Kronecker block, with the curvature
    ``η`` of the weight decay (``weight_decay``) its weights get."""
    return hyperparam.damping + hyperparam.weight_decay


def batch_norm_damping(hyperparam):
    """``m ε``: the damping of a BatchNorm block (``m`` the
    ``bn_damping_multiplier``)."""
    return hyperparam.bn_damping_multiplier * hyperparam.damping


def factored_damping(factors, damping):
    """Returns the damping added to each of the ``k`` Kronecker
    ``factors``: ``π_i ε^(1/k)``, with ``Π π_i = 1``.

    Each ``π_i`` rescales the factor's share of ``ε`` by the geometric
    mean of the ratios of its mean eigenvalue ``m_i = tr(F_i) / dim F_i``
    to the others' (Ba, Grosse & Martens 2017 §4.1, Eq. 12, which
    minimises a bound on the error's nuclear norm; Martens & Grosse 2015
    §6.3 for ``k = 2``)::

        π_i = (m_i^k / Π_j m_j)^(1/k)       (k = 2: π_A = sqrt(m_A / m_G))

    When a trace is zero or not finite (e.g. all-zero activations) every
    π falls back to 1, so the damping still makes each factor positive
    definite.
    """
    means = []
    for F in factors:
        xp = backend.get_array_module(F)
        means.append(float(xp.trace(F)) / F.shape[0])
    k = len(means)
    root = damping ** (1 / k)
    geometric = math.prod(means) ** (1 / k)
    if not (geometric > 0 and math.isfinite(geometric)
            and all(m > 0 and math.isfinite(m) for m in means)):
        return (root,) * k
    return tuple(m / geometric * root for m in means)


def add_diagonal(M, value):
    """Returns ``M + value I`` without touching ``M``."""
    xp = backend.get_array_module(M)
    out = M.copy()
    idx = xp.arange(M.shape[0])
    out[idx, idx] += value
    return out


def _cholesky(M):
    """Lower Cholesky factor of a symmetric positive-definite ``M``
    (``numpy.linalg.LinAlgError`` when it is not)."""
    xp = backend.get_array_module(M)
    if xp is numpy:
        from scipy.linalg import lapack
        potrf, = lapack.get_lapack_funcs(('potrf',), (M,))
        L, info = potrf(M, lower=True, clean=True)
        if info != 0:
            raise numpy.linalg.LinAlgError('not positive definite')
        return L
    L = xp.linalg.cholesky(M)
    # cuSOLVER reports failure through NaNs when it may not synchronise.
    if not bool(xp.isfinite(L).all()):
        raise numpy.linalg.LinAlgError('not positive definite')
    return L


def _cholesky_inverse(M):
    """Inverse of a symmetric positive-definite ``M`` via Cholesky
    (``numpy.linalg.LinAlgError`` when it is not)."""
    xp = backend.get_array_module(M)
    if xp is numpy:
        # LAPACK potrf + potri: faster than numpy.linalg.inv on SPD
        # factors (it uses the symmetry).
        from scipy.linalg import lapack
        potrf, potri = lapack.get_lapack_funcs(('potrf', 'potri'), (M,))
        c, info = potrf(M, lower=False, clean=False)
        if info != 0:
            raise numpy.linalg.LinAlgError('not positive definite')
        inv, info = potri(c, lower=False, overwrite_c=True)
        if info != 0:
            raise numpy.linalg.LinAlgError('potri failed')
        # potri fills the upper triangle; mirror it in one masked pass.
        upper = upper_mask(xp, M.shape[0], backend.get_device_from_array(M))
        numpy.copyto(inv, inv.T, where=upper.T)
        return inv
    L = _cholesky(M)
    L_inv = _solve_lower(L, xp.eye(M.shape[0], dtype=M.dtype))
    return L_inv.T @ L_inv


def _solve_lower(L, B, trans='N'):
    """``L⁻¹ B`` (``L⁻ᵀ B`` for ``trans='T'``) for a lower-triangular
    ``L``."""
    if backend.get_array_module(L) is numpy:
        import scipy.linalg
        return scipy.linalg.solve_triangular(L, B, trans=trans, lower=True,
                                             check_finite=False)
    import cupyx.scipy.linalg
    return cupyx.scipy.linalg.solve_triangular(L, B, trans=trans, lower=True)


def cholesky_panel(panel):
    """One step of a blocked Cholesky factorization ``M = L Lᵀ``, in place.

    ``panel`` holds columns ``j:j+w`` of a symmetric positive-definite
    ``M`` from row ``j`` down, ``[M_jj; M_rj]``, from which the panels to
    its left were already subtracted (``M_·j - Σ L_·k L_jkᵀ``). It becomes
    the same columns of ``L``::

        L_jj = chol(M_jj),    L_rj = M_rj L_jj⁻ᵀ

    ``numpy.linalg.LinAlgError`` when ``M_jj`` is not positive definite
    (:func:`chainerkfac.distributed.cholesky.shared_cholesky` shares a
    factorization between ranks this way, panel by panel)."""
    w = panel.shape[1]
    L_jj = _cholesky(panel[:w])
    panel[:w] = L_jj
    if len(panel) > w:
        panel[w:] = _solve_lower(L_jj, panel[w:].T).T
    return panel


def symmetric_eigh(M):
    """Eigendecomposition ``M = Q diag(λ) Qᵀ`` with λ clipped at zero.

    A factor is positive semi-definite in exact arithmetic; round-off can make
    its smallest eigenvalues slightly negative, which damping must not see.
    """
    xp = backend.get_array_module(M)
    w, Q = xp.linalg.eigh(M)
    return xp.maximum(w, 0), Q


def _damped(M, damping, factorize):
    """``factorize(M + damping I)`` for a symmetric PSD ``M``; never NaN.

    If the damped matrix is not numerically positive definite, it is retried
    with growing jitter, and finally replaced by its eigendecomposition with
    eigenvalues floored at a positive value.
    """
    xp = backend.get_array_module(M)
    damped = damped_factor(M, damping)
    scale = float(xp.abs(xp.diagonal(damped)).mean()) or 1.0
    jitter = 0.0
    for k in range(_JITTER_TRIES):
        try:
            out = factorize(
                add_diagonal(damped, jitter) if jitter else damped)
        except numpy.linalg.LinAlgError:
            jitter = scale * _JITTER_START * 10 ** k
            continue
        if bool(xp.isfinite(out).all()):
            return out
        jitter = scale * _JITTER_START * 10 ** k
    w, Q = symmetric_eigh(M)
    floor = max(damping, scale * _JITTER_START * 10 ** _JITTER_TRIES)
    return factorize((Q * (w + floor)) @ Q.T)


def damped_factor(M, damping):
    """``M + damping I`` for a factor ``M`` free of NaN and Inf (else
    ``FloatingPointError``): what every inverse and Cholesky factor here is
    taken of."""
    xp = backend.get_array_module(M)
    if not bool(xp.isfinite(M).all()):
        raise FloatingPointError('cannot invert a factor with NaN or Inf')
    return add_diagonal(M, damping)


def damped_inverse(M, damping):
    """Returns ``(M + damping I)⁻¹`` for a symmetric PSD ``M``; never NaN."""
    return _damped(M, damping, _cholesky_inverse)


def damped_cholesky(M, damping):
    """Returns the lower ``L`` with ``L Lᵀ = M + damping I``; never NaN.

    A factor is ``d³/3`` operations, a third of an explicit inverse; see
    :func:`explicit_inverse_pays` for when each pays.
    """
    return _damped(M, damping, _cholesky)


#: ``C`` of :func:`explicit_inverse_pays`: three times the steps after
#: which explicit inverses of a square layer's factors (``dim A = dim G``)
#: have paid for themselves (measured: benchmarks/tuning_measurements.md,
#: "The cost of a K-FAC step").
EXPLICIT_INVERSE_BREAK_EVEN = 8


def explicit_inverse_pays(dim_A, dim_G, reuse):
    """Whether to form ``A_d⁻¹, G_d⁻¹`` rather than keep Cholesky factors.

    With ``a = dim A``, ``g = dim G``: the explicit inverses cost ``potri``
    on top of the factors, about ``(a³ + g³) 2/3`` operations once; the
    Cholesky factors are applied by triangular solves, which do the work of
    the products ``2 a g (a + g)`` more slowly, at every step the inverse
    serves. The inverses pay when::

        reuse >= C (a³ + g³) / (3 a g (a + g)),
        C = EXPLICIT_INVERSE_BREAK_EVEN

    The ratio is at least 1/3 (at ``a = g``), so an inverse used for one
    step is never formed explicitly; it is about 2.7 for a 3x3 convolution
    (``a = 9 g``), which needs some 20 steps.
    """
    a, g = float(dim_A), float(dim_G)
    return reuse * 3 * a * g * (a + g) >= \
        EXPLICIT_INVERSE_BREAK_EVEN * (a ** 3 + g ** 3)


def kronecker_precondition(grad, A_inv, G_inv):
    """``V = G_d⁻¹ ∇W̄ A_d⁻¹`` for the inverses of the damped factors."""
    return G_inv @ grad @ A_inv


def low_rank_precondition(left, right, A_inv, G_inv):
    """``V = G_d⁻¹ (Lᵀ R) A_d⁻¹ = (G_d⁻¹ Lᵀ)(R A_d⁻¹)`` for a gradient
    ``∇W̄ = Lᵀ R`` of ``N`` columns (``L`` of shape ``(N, d_G)``, ``R``
    ``(N, d_A)``): ``N (d_G² + d_A² + d_G d_A)`` operations instead of
    ``d_G d_A (d_A + d_G)``."""
    return (G_inv @ left.T) @ (right @ A_inv)


def doubly_factored_product(grad, K, Psi, G):
    """``(Ψ ⊗ K ⊗ G) vec(∇)``, as an ``(out, C T)`` matrix: the weight
    gradient ``∇`` of shape ``(out, C T)`` (input channel ``c``, position
    ``t`` at column ``c T + t``) taken as a tensor ``(out, C, T)`` and
    multiplied along each axis by one symmetric factor, ``∇ ×₁ G ×₂ Ψ ×₃
    K`` (Ba, Grosse & Martens 2017 §4, Eq. 9, with the factors or their
    damped inverses).
    """
    out, C, T = G.shape[0], Psi.shape[0], K.shape[0]
    V = (G @ grad).reshape(out * C, T) @ K
    return (Psi @ V.reshape(out, C, T)).reshape(out, C * T)


def _cholesky_solve(L, B):
    """``(L Lᵀ)⁻¹ B`` by two triangular solves."""
    xp = backend.get_array_module(L)
    if xp is numpy:
        from scipy.linalg import lapack
        potrs, = lapack.get_lapack_funcs(('potrs',), (L,))
        X, info = potrs(L, B, lower=True)
        if info != 0:
            raise numpy.linalg.LinAlgError('potrs failed')
        return X
    return _solve_lower(L, _solve_lower(L, B), trans='T')


def inverse_of_cholesky(L):
    """``(L Lᵀ)⁻¹``: the inverse of a damped factor from its Cholesky
    factor (an inverse form changing kind, :meth:`Split.adopt
    <chainerkfac.distributed.split.Split.adopt>`)."""
    xp = backend.get_array_module(L)
    return _cholesky_solve(L, xp.eye(len(L), dtype=L.dtype))


def cholesky_of_inverse(M_inv):
    """The lower Cholesky factor of ``M`` from ``M⁻¹`` (the same change of
    kind, the other way)."""
    return _cholesky(_cholesky_inverse(M_inv))


def cholesky_precondition(grad, L_A, L_G):
    """``V = G_d⁻¹ ∇W̄ A_d⁻¹`` from the Cholesky factors ``A_d = L_A L_Aᵀ``,
    ``G_d = L_G L_Gᵀ``: ``A_d⁻¹ ∇W̄ᵀ``, transposed, then ``G_d⁻¹ (·)``."""
    return _cholesky_solve(L_G, _cholesky_solve(L_A, grad.T).T)


def cholesky_low_rank_precondition(left, right, L_A, L_G):
    """:func:`low_rank_precondition` from the Cholesky factors of
    :func:`cholesky_precondition`: ``(G_d⁻¹ Lᵀ)(A_d⁻¹ Rᵀ)ᵀ``."""
    return _cholesky_solve(L_G, left.T) @ _cholesky_solve(L_A, right.T).T


def mixed_precondition(grad, A_inv=None, G_inv=None, A_chol=None,
                       G_chol=None):
    """``V = G_d⁻¹ ∇W̄ A_d⁻¹`` from the explicit inverse of one factor and
    the Cholesky factor of the other: ``(A_d⁻¹ (G_d⁻¹ ∇W̄)ᵀ)ᵀ`` for
    ``G_inv, A_chol``, ``G_d⁻¹ (∇W̄ A_d⁻¹)`` for ``A_inv, G_chol``.

    Rows ``I`` of ``G_inv`` (columns ``J`` of ``A_inv``) give rows ``I``
    (columns ``J``) of ``V``: how ranks share a block whose larger factor
    is not inverted explicitly (distributed K-FAC, split blocks).
    """
    if A_chol is not None:
        return _cholesky_solve(A_chol, (G_inv @ grad).T).T
    return _cholesky_solve(G_chol, grad @ A_inv)


def eigen_precondition(grad, eig_A, eig_G, damping):
    """``V = Q_G [(Q_Gᵀ ∇W̄ Q_A) / (λ_G λ_Aᵀ + ε)] Q_Aᵀ`` (exact damping)."""
    w_A, Q_A = eig_A
    w_G, Q_G = eig_G
    inner = Q_G.T @ grad @ Q_A
    inner /= w_G[:, None] * w_A[None, :] + damping
    return Q_G @ inner @ Q_A.T


def eigen_precondition_single(grad, eig, damping):
    """``Q diag(1 / (λ + ε)) Qᵀ g`` for a single (BatchNorm) block."""
    w, Q = eig
    return Q @ ((Q.T @ grad) / (w + damping))


def diagonal_inverse(diag, damping):
    """``1 / (f + ε)``: a damped diagonal Fisher, inverted element-wise."""
    return 1 / (diag + damping)


_upper_masks = {}


def upper_mask(xp, dim, device):
    """Boolean mask of the upper triangle (diagonal included), one per
    size and device: ``M[mask]`` lists it row by row (C order), in an
    eighth of the memory of ``triu_indices``' two index arrays."""
    key = (str(device), dim)
    mask = _upper_masks.get(key)
    if mask is None:
        mask = _upper_masks[key] = xp.triu(xp.ones((dim, dim), dtype=bool))
    return mask
