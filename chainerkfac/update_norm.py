"""The update-norm guard: a bound on the approximate KL change of a step.

Ba et al. 2017 §5 (after Grosse & Martens 2016, as §5 says). With ``g_b`` the
gradient a K-FAC block ``b`` preconditioned and ``V_b = F̂_b⁻¹ g_b`` the
result, a step ``Δ = −η V`` (before momentum) changes the model's output
distribution by a KL divergence of about ``½ ΔᵀF̂Δ = ½ η² Σ_b ⟨V_b, g_b⟩``,
since ``F̂_b V_b = g_b``. The guard measures::

    q = η² Σ_b ⟨V_b, g_b⟩          (twice that KL change)
    ν = min(1, sqrt(κ / q))

and multiplies every block's ``V`` by ``ν`` before the momentum update, so
that ``ν² q ≤ κ``: a large learning rate, or a damped inverse of stale
curvature that is far too small, cannot move the model further than the
bound ``κ`` (the ``kl_clip`` option of :class:`~chainerkfac.optimizers.KFAC`)
allows. The convention (no factor ½ in ``q``) is kfac-pytorch's ``kl_clip``.

The bound grows with the global batch ``B``: with ``r = B / B₀``,
``B₀`` the ``kl_clip_batch`` option (64 by default; ``None`` keeps
``κ = kl_clip``)::

    κ = kl_clip · r · max(r, 1)     (r² above B₀, r below it)

Larger batches take fewer steps an epoch and need longer ones: Goyal et
al. (2017) scale the learning rate with ``B``, so ``η²`` in ``q`` grows like
``B²``, while the noise part of ``⟨V, g⟩`` falls like ``1/B`` and its mean
part does not. A step at the scaled learning rate therefore has a ``q`` that
grows like ``B`` where the noise dominates it, in small batches, and like
``B²`` where the mean gradient does, in large ones; the bound follows, so
that the guard lets the same steps through at every batch. Measured
(``docs/guide/tuning.md``): at batch 64 a bound of 1e-4 gave the best
final accuracies across four models; growing like ``B`` it left K-FAC
behind MomentumSGD at batch 1024 on ``shapes`` (0.469 against 0.591),
like ``B²`` ahead (0.644 to 0.691); below 64, ``B²`` cost K-FAC its lead
on the digits at batch 32 (iterations to 97 % 0.92x MomentumSGD's against
0.66x growing like ``B``).

Parameters outside the K-FAC blocks follow momentum SGD and are not
scaled. The gradients carry the loss scale ``s`` of float16 training, so
``q`` is divided by ``s²``. Under MPI each rank adds the terms of the
blocks (or parts of blocks) it preconditioned; the partial sums travel in
the all-gather the step already makes and every rank adds them in rank
order, so every rank applies the same ``ν``.
"""
import math

from chainer import backend


def inner(preconditioned, gradient):
    """``⟨V, g⟩``: the block's term of ``Σ_b ⟨V_b, g_b⟩``, as a 0-d array
    of the arrays' module (read back once per step, not once per block)."""
    xp = backend.get_array_module(gradient)
    return xp.vdot(preconditioned.ravel(), gradient.ravel())


def kl_estimate(inner_sum, lr, loss_scale=None):
    """``q = η² Σ_b ⟨V_b, g_b⟩`` from the summed inner products."""
    q = lr * lr * float(inner_sum)
    if loss_scale is not None:
        q /= loss_scale * loss_scale
    return q


def bound(kl_clip, batch, reference):
    """``κ = kl_clip · r · max(r, 1)``, ``r = batch / reference``;
    ``kl_clip`` itself when ``reference`` or ``batch`` is ``None`` (no batch
    seen yet), ``None`` when the guard is off."""
    if kl_clip is None or reference is None or batch is None:
        return kl_clip
    ratio = batch / reference
    return kl_clip * ratio * max(ratio, 1.0)


def scale(q, bound):
    """``ν = min(1, sqrt(κ / q))``; 1 when the guard is off (``bound`` is
    ``None``) or ``q`` is not positive."""
    if bound is None or not q > 0:
        return 1.0
    return min(1.0, math.sqrt(bound / q))
