"""Low-rank preconditioning: a Linear's step from its batch's columns.

A Linear layer's weight gradient is a sum over its batch's rows (samples,
and positions where the input has more batch axes)::

    ∇W̄ = Σ_i (∂L/∂s_i) ā_iᵀ = Lᵀ R,

``L`` the ``(N, d_G)`` output gradients and ``R`` the ``(N, d_A)`` inputs
(with a homogeneous 1 for the bias). Under factored damping ``F̂⁻¹`` is a
Kronecker product of two inverses, so the preconditioned gradient is, to
round-off::

    V = G_d⁻¹ ∇W̄ A_d⁻¹ = (G_d⁻¹ Lᵀ)(R A_d⁻¹)

in ``N (d_G² + d_A² + d_G d_A)`` operations instead of the dense
``d_G d_A (d_A + d_G)``: fewer where ``N`` is below about two thirds of the
layer's width (the dense form's cost is the batch-independent
``(A_d⁻¹ ⊗ G_d⁻¹) vec(∇W̄)`` of Martens & Grosse 2015, §3; the product of
the batch's rows is how per-example gradients give the batch's, Goodfellow
2015).

The step's training passes keep the rows (:class:`Rows`, filled by
:class:`chainerkfac.hooks.StatisticsHook`) only where they can be the whole
gradient: the optimizer allows it in one process without optimizer hooks
or K-FAC's ``weight_decay``, which add to the gradient, and :func:`agrees`
checks every step, with one matrix-vector product, that nothing else did
(a loss term on the weights themselves, a pass without a backward pass);
otherwise the block takes the dense product.
"""
from chainer import backend
import numpy

#: Low-rank preconditioning is taken where its operations are below this
#: fraction of the dense product's: the rows' copy, the check and the
#: thinner products cost the rest.
PAYS_BELOW = 0.75


def pays(rows, d_A, d_G):
    """Whether ``rows`` rows make the low-rank product cheaper than the
    dense one for factors of sizes ``d_A`` and ``d_G``."""
    low_rank = rows * (d_G * d_G + d_A * d_A + d_G * d_A)
    return low_rank < PAYS_BELOW * d_G * d_A * (d_A + d_G)


def _probe(xp, size, dtype):
    """A fixed vector with no structure a gradient could share."""
    return xp.cos(xp.arange(size, dtype=dtype) * 0.7 + 0.3)


def agrees(grad, left, right):
    """Whether ``grad`` is ``leftᵀ right`` to round-off, compared along
    one fixed vector ``r``: ``∇W̄ r`` against ``Lᵀ (R r)``, within
    ``1e-3`` (float32; ``1e-9`` in float64) of ``|L|ᵀ (|R| |r|)``."""
    xp = backend.get_array_module(grad)
    r = _probe(xp, grad.shape[1], grad.dtype)
    difference = grad @ r - left.T @ (right @ r)
    bound = xp.abs(left).T @ (xp.abs(right) @ xp.abs(r))
    rtol = 1e-3 if grad.dtype.itemsize <= 4 else 1e-9
    return bool(xp.all(xp.abs(difference) <= rtol * bound + 1e-30))


class Rows:
    """The inputs and output gradients of one layer's training passes
    since the last step, each pass's pair under the token
    :meth:`add_input` gave it (a layer called twice gets its output
    gradients in the reverse order of its inputs)."""

    def __init__(self):
        self.inputs = []
        self.gradients = {}
        #: The factor the gradient was scaled by after the passes (the
        #: mean over ``acc_iters`` micro-batches).
        self.scale = 1.0

    def __len__(self):
        """The rows kept so far."""
        return sum(len(x) for x in self.inputs)

    def add_input(self, x):
        """Keeps the ``(n, d)`` rows ``x``; returns their token."""
        self.inputs.append(x)
        return len(self.inputs) - 1

    def add_gradient(self, token, gy):
        """Keeps the ``(n, d_G)`` output gradient of pass ``token``."""
        self.gradients[token] = gy

    def clear(self):
        self.inputs, self.gradients, self.scale = [], {}, 1.0

    def take(self, bias):
        """``(L, R)`` of every pass (``R`` with a column of ones if
        ``bias``), or ``None`` if a pass had no output gradient; clears
        the rows either way."""
        inputs, gradients, scale = self.inputs, self.gradients, self.scale
        self.clear()
        if not inputs or len(gradients) != len(inputs):
            return None
        xp = backend.get_array_module(inputs[0])
        left = xp.concatenate([gradients[k] for k in range(len(inputs))])
        right = xp.concatenate(inputs)
        if bias:
            right = xp.concatenate(
                [right, xp.ones((len(right), 1), dtype=right.dtype)], axis=1)
        if left.dtype != right.dtype:
            dtype = numpy.promote_types(left.dtype, right.dtype)
            left, right = left.astype(dtype), right.astype(dtype)
        if scale != 1:
            left = left * left.dtype.type(scale)
        return left, right
