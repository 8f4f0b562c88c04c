"""The update-norm guard: a bound on the approximate KL change of a step.

Ba et al. 2017 §5 (after Grosse & Martens 2016, as §5 says). With ``g_b``
the gradient a K-FAC block ``b`` preconditioned, ``V_b = F̂_b⁻¹ g_b`` and
``ρ_b`` the step rule's scale (:mod:`chainerkfac.step_rule`), a step
``Δ_b = −η ρ_b V_b`` (before momentum) changes the model's output
distribution by a KL divergence of about
``½ ΔᵀF̂Δ = ½ η² Σ_b ρ_b² ⟨V_b, g_b⟩``, since ``F̂_b V_b = g_b``. The guard
measures::

    q = η² Σ_b ρ_b² ⟨V_b, g_b⟩          (twice that KL change)
    ν = min(1, sqrt(κ / q))

and multiplies every block's step by ``ν`` before the momentum update, so
that ``ν² q ≤ κ``: a learning rate far too large for the model, or a damped
inverse of stale curvature that is far too small, cannot move the model
further than the bound ``κ`` (the ``kl_clip`` option of
:class:`~chainerkfac.optimizers.KFAC`) allows. The convention (no factor ½
in ``q``) is kfac-pytorch's ``kl_clip``. With the default
``kl_clip_follows_lr=True`` (:class:`FollowedBound`) the bound is
``kl_clip`` at the schedule's peak learning rate and shrinks with the
schedule's square, so warm-up and decay act on a step the guard sets.

The bound grows with the global batch ``B``: with ``r = B / B₀``,
``B₀`` the ``kl_clip_batch`` option (64 by default; ``None`` keeps
``κ = kl_clip``)::

    κ = min(kl_clip · r · max(r, 1), max(kl_clip, GROWN_MAX))

like ``r`` below ``B₀``, like ``r²`` above it, to at most
:data:`GROWN_MAX`. Larger batches take fewer steps an epoch and need
longer ones: Goyal et al. (2017) scale the learning rate with ``B``, so
``η²`` in ``q`` grows like ``B²``, while the noise part of ``⟨V, g⟩`` falls
like ``1/B`` and its mean part does not. A step at the scaled learning
rate therefore has a ``q`` that grows like ``B`` where the noise dominates
it, in small batches, and like ``B²`` where the mean gradient does, in
large ones; the bound follows. Measured (``docs/benchmarks.md``): under
the natural step, growing like ``B`` the bound left K-FAC behind
MomentumSGD at batch 1024 on ``shapes`` (0.469 against 0.591), like ``B²``
ahead (0.644 to 0.691); below 64, ``B²`` cost K-FAC its lead on the digits
at batch 32. Under the default step rule at a large-batch recipe's peak
learning rates the bound sets every step, and there the growth has to
stop: at batch 1024 on ``shapes`` (``κ`` 2.56 grown, 0.64 held) it reached
MomentumSGD's best accuracy in 14.5 epochs against 8.5. The ``q`` of a
step is a quadratic estimate, trusted only for small changes of the
model's outputs; 0.64 is twice a KL change of 0.32.

A fixed bound cannot tell a model blowing up from one whose steps are
large from the start and fall: a network whose first gradients are large
(a ResNet, a plain deep CNN) has a ``q`` that starts well above ``κ`` and
decreases as it learns, so a fixed ``κ`` sets its first steps whatever the
learning rate, while a model blowing up has a ``q`` that grows by orders
of magnitude at a fixed learning rate. With ``c`` the ``kl_clip_relative``
option, :class:`RelativeBound` raises the bound to ``c`` times the
smallest step the run has taken, at the current learning rate::

    m_t = min_{s ≤ t} q_s / η_s²         (the learning rate divided out)
    κ_t = max(κ, c η_t² m_t)

so that the guard binds only where ``q`` is over ``c`` times the smallest
the run has had at this learning rate, or over ``κ``, whichever is
larger. A learning-rate schedule moves the bound with ``η_t²``, as it moves
``q``; a run whose ``q`` only falls keeps its steps; one whose ``q`` grows
is cut back to ``c η_t² m_t`` (to ``κ`` once ``m_t`` is small). The step
being taken counts in ``m_t``, so the first steps of a learning rate far
too large for the model are not told apart from those of one that learns
and go through (measured in ``docs/benchmarks.md``: why it is an option).
Every rank computes ``q`` from the same sums, so every rank holds the same
``m_t``.

Parameters outside the K-FAC blocks follow momentum SGD and are not
scaled. The gradients carry the loss scale ``s`` of float16 training, so
``q`` is divided by ``s²``. Under MPI every rank adds the step rule's sums
of every block in rank order (:mod:`chainerkfac.step_rule`), so that every
rank applies the same ``ν``.
"""
import logging
import math

import chainer

logger = logging.getLogger(__name__)


def kl_estimate(inner_sum, lr, loss_scale=None):
    """``q = η² Σ_b ρ_b² ⟨V_b, g_b⟩`` from the summed, scaled inner
    products ``inner_sum``."""
    q = lr * lr * float(inner_sum)
    if loss_scale is not None:
        q /= loss_scale * loss_scale
    return q


#: The most the batch grows the bound to (a ``kl_clip`` above it is kept):
#: the largest ``q`` the measurements trusted a step with.
GROWN_MAX = 0.64


def bound(kl_clip, batch, reference):
    """``κ = min(kl_clip · r · max(r, 1), max(kl_clip, GROWN_MAX))``,
    ``r = batch / reference``; ``kl_clip`` itself when ``reference`` or
    ``batch`` is ``None`` (no batch seen yet), ``None`` when the guard is
    off."""
    if kl_clip is None or reference is None or batch is None:
        return kl_clip
    ratio = batch / reference
    return min(kl_clip * ratio * max(ratio, 1.0), max(kl_clip, GROWN_MAX))


class FollowedBound:
    """The bound following the learning rate's schedule (the
    ``kl_clip_follows_lr`` option)::

        κ_t = kl_clip · (η_t / η̂_t)²,    η̂_t = max(η_0, max_{s ≤ t} η_s)

    ``η_0`` the learning rate the optimizer was built with, ``η̂_t`` the
    largest the run has had since, so that the bound is ``kl_clip`` at the
    schedule's peak and never above it, however the schedule starts (an
    optimizer built at the default lr and set higher, a warm-up from
    below). Where the guard binds, the step is then
    ``(η_t / η̂_t) sqrt(κ / Σρ²⟨V, g⟩) ρV``: a step of a fixed KL change,
    which warm-up and decay scale as they scale SGD's step (the guard's
    ``q`` grows with ``η²``). ``η̂_t`` is kept in snapshots.
    """

    def __init__(self, reference_lr):
        #: ``η̂_t``; ``None``: the bound does not follow the schedule.
        self.peak = reference_lr

    def bound(self, kl_clip, lr):
        """``κ_t`` at learning rate ``lr``, which joins ``η̂_t`` (``kl_clip``
        itself when the bound does not follow, ``None`` when the guard is
        off). ``η̂_t`` depends on the schedule alone, so a step skipped
        afterwards still counts in it."""
        if kl_clip is None or self.peak is None:
            return kl_clip
        self.peak = max(self.peak, lr)
        if not self.peak > 0:
            return kl_clip  # no step yet: q is 0 too
        return kl_clip * (lr / self.peak) ** 2

    def serialize(self, serializer):
        """Saves or loads ``η̂_t`` (a snapshot taken without
        ``kl_clip_follows_lr`` leaves the built learning rate)."""
        if self.peak is None:
            return
        try:
            self.peak = float(serializer('peak_lr', self.peak))
        except KeyError:
            pass


def scale(q, bound):
    """``ν = min(1, sqrt(κ / q))``; 1 when the guard is off (``bound`` is
    ``None``) or ``q`` is not positive."""
    if bound is None or not q > 0:
        return 1.0
    return min(1.0, math.sqrt(bound / q))


class RelativeBound:
    """The bound relative to the run's own steps: ``κ_t = max(κ, c η_t²
    m_t)`` with ``m_t = min_{s ≤ t} q_s / η_s²`` over the steps taken
    (``c`` the ``kl_clip_relative`` option).

    The step being taken counts in ``m_t``, so the first step is never
    scaled by more than the fixed bound would (``κ_1 ≥ c q_1``): a
    learning rate far too large from the first step goes through, which
    is what the fixed bound alone stops. :meth:`bound` leaves ``m_t`` as it
    is; :meth:`accept` adds the step once it is taken (a step skipped
    for non-finite values does not count).
    """

    def __init__(self):
        #: ``m_t``, or ``None`` before the first step taken with a positive,
        #: finite ``q``.
        self.smallest = None
        self._candidate = None

    def bound(self, bound, relative, q, lr):
        """``κ_t`` from the fixed bound ``κ`` (``None``: the guard is off),
        ``c`` (``relative``; ``None`` keeps ``κ`` and follows no ``m_t``)
        and this step's ``q`` at learning rate ``lr``, which joins ``m_t``
        if it is positive and finite."""
        self._candidate = self.smallest
        if relative is None:
            return bound
        if q > 0 and lr > 0 and math.isfinite(q):
            ratio = q / (lr * lr)
            self._candidate = ratio if self.smallest is None \
                else min(self.smallest, ratio)
        if bound is None or self._candidate is None:
            return bound
        return max(bound, relative * lr * lr * self._candidate)

    def accept(self):
        """The step last passed to :meth:`bound` was taken: ``m_t``
        includes it."""
        self.smallest = self._candidate

    def serialize(self, serializer, relative):
        """Saves or loads ``m_t`` (``-1``: none yet); loading none where
        ``relative`` (``c``) is set says that ``m_t`` starts afresh."""
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        value = float(serializer(
            'smallest_q_over_lr2',
            -1.0 if self.smallest is None else self.smallest))
        if not loading:
            return
        self.smallest = None if value < 0 else value
        if self.smallest is None and relative is not None:
            logger.warning(
                'the snapshot holds no smallest q / lr^2 of the update-norm '
                "guard's relative bound (kl_clip_relative): it starts "
                'afresh from the next step')
