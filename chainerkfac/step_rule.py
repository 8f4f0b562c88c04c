"""The step's length: the step rule and the bound on the step's KL change.

Preconditioning gives every block ``b`` a direction ``V_b = F̂_b⁻¹ g_b``
(``g_b`` the gradient the block preconditioned: optimizer hooks such as
``WeightDecay`` and K-FAC's own ``weight_decay`` term included). The step,
before the update rule's momentum (``v <- μ v − η V; w <- w + v``), is::

    Δ_b = −η ν ρ_b V_b

``ρ_b`` the step rule's scale and ``ν`` the bound's, both computed from
three sums per block, which the stages add over processes in the
all-gather the step already makes, so that every process takes the same
step::

    ⟨V_b, g_b⟩    ⟨V_b, V_b⟩    ⟨g_b, g_b⟩

**Rules** (the ``step_rule`` option of :class:`~chainerkfac.optimizers.KFAC`):

* :class:`KLGraft` (``'kl_graft'``, the default): the natural direction
  over all blocks together, with the KL change of layer-wise grafting's
  step (Agarwal et al. 2020 §3: each block as long as SGD's step
  ``η g_b``, ``ρ_b = ‖g_b‖ / ‖V_b‖``) grown like the batch, one scale for
  every block::

      ρ² = (B / B₀) Σ_b (‖g_b‖² / ‖V_b‖²) ⟨V_b, g_b⟩ / Σ_b ⟨V_b, g_b⟩

  The learning rate keeps SGD's units, while the curvature divides the
  step among the layers as the natural step does. The factor ``B / B₀``
  is the bound's (below): the grafted step's KL change falls like ``1/B``
  with the gradient's noise, and the step keeps it, as SGD's
  square-root scaling of the learning rate does (Krizhevsky 2014; Hoffer
  et al. 2017), so that at large batches the bound, not SGD's length,
  sets the step.
* :class:`Natural` (``'natural'``): ``ρ_b = 1``, the natural-gradient step
  ``η F̂⁻¹ g`` of Osawa et al. (2019), whose length the learning rate, the
  curvature and the damping set together.
* ``'adaptive'`` (:mod:`chainerkfac.optimizers.quadratic_model`): the step
  length, momentum and damping from the loss's quadratic model (Martens &
  Grosse 2015 §6-7); without a learning rate or the bound.

**The bound**: a step of fixed KL change (Ba et al. 2017 §5, after Grosse
& Martens 2016). The step changes the model's output distribution by a KL
divergence of about ``½ ΔᵀF̂Δ = ½ q``, since ``F̂_b V_b = g_b``::

    q = η² ρ² Σ_b ⟨V_b, g_b⟩ / s²            (s: the loss scale)
    κ_t = kl_clip · (B / B₀) · (η_t / η̂_t)²
    ν = min(1, sqrt(κ_t / q))

``B`` the step's global batch, ``B₀`` :data:`REFERENCE_BATCH`, ``η̂_t =
max(η_0, max_{s ≤ t} η_s)`` the largest learning rate the run has had
(``η_0`` the one the optimizer was built with). Where it binds, the step
is ``F̂⁻¹g`` scaled to the KL change ``½ κ_t``: of all steps with that KL
change, the one whose first-order decrease of the loss is largest (Amari
1998, as Ba et al. 2017 §2.2 restate it). The schedule scales it as it
scales SGD's step. The batch: ``⟨V, g⟩`` holds the mean gradient's part
and a noise part that falls like ``1/B``, so at a fixed ``κ / B`` the
bound's step grows like ``B`` where the noise dominates (Goyal et al.
2017's linear scaling) and like ``sqrt(B)`` where the mean gradient does.
``kl_clip=None`` turns it off (the paper's recipe). A frozen block's sums
count in neither ``ρ`` nor ``q``.

A block without an inverse yet has ``V_b = g_b``.
"""
import math
import typing

from chainer import backend
import numpy

#: The per-block sums, in their order in a row of :func:`block_sums`.
TERMS = ('vg', 'vv', 'gg')
N_TERMS = len(TERMS)
#: ``B₀``: the global batch at which the bound is ``kl_clip``.
REFERENCE_BATCH = 64


def batch_ratio(batch):
    """``B / B₀``, by which the bound and ``kl_graft``'s KL change grow
    (``batch`` ``None``: not known, taken as ``B₀``)."""
    return (batch or REFERENCE_BATCH) / REFERENCE_BATCH


def block_sums(preconditioned, gradient):
    """``[⟨V, g⟩, ⟨V, V⟩, ⟨g, g⟩]`` for one block (or one part of a block:
    they add over parts), one row of the arrays' module, in the order of
    :data:`TERMS` (read back once per step, not once per block)."""
    xp = backend.get_array_module(gradient)
    V, g = preconditioned.ravel(), gradient.ravel()
    return xp.stack([xp.vdot(V, g), xp.vdot(V, V), xp.vdot(g, g)])


class Sums(typing.NamedTuple):
    """The per-block sums of the step over every process: NumPy vectors
    of one entry per block."""

    vg: numpy.ndarray
    vv: numpy.ndarray
    gg: numpy.ndarray

    @classmethod
    def of(cls, rows):
        """The sums of ``rows``, ``(blocks, N_TERMS)``, rows of
        :func:`block_sums` (or their sums over processes)."""
        rows = numpy.asarray(rows, dtype=numpy.float64)
        return cls(*rows.reshape(-1, N_TERMS).T.copy())

    def without(self, indices):
        """The sums with the blocks at ``indices`` zero (a frozen block
        takes no step, so its sums count in neither ``ρ`` nor ``q``)."""
        indices = list(indices)
        if not indices:
            return self

        def cleared(vector):
            vector = vector.copy()
            vector[indices] = 0
            return vector
        return Sums(*map(cleared, self))


def rescale(blocks, scales):
    """``V_b <- scales[b] V_b`` in the gradients of each of ``blocks``."""
    for block, factor in zip(blocks, scales):
        if factor != 1:
            for param in block.params():
                if param.grad is not None:
                    param.grad *= float(factor)


def typical(scales):
    """The geometric mean of the positive ``scales`` (1 if none): what
    ``kfac/step_scale`` reports, the factor by which the rule typically
    changed K-FAC's natural step."""
    positive = scales[scales > 0]
    return float(numpy.exp(numpy.log(positive).mean())) if len(positive) \
        else 1.0


class StepRule:
    """Turns the gathered per-block sums into the blocks' scales ``ρ``."""

    #: The option's name for the rule.
    name = None
    #: Whether the rule chooses the whole update, momentum included, and
    #: the damping (:mod:`chainerkfac.optimizers.quadratic_model`): the
    #: optimizer then calls its ``check``, ``keep_gradient``, ``choose``
    #: and ``after_update`` around the step, and the bound is off (the
    #: rule's ``α`` would undo it).
    chooses_update = False

    def scales(self, sums, batch=None):
        """``ρ`` per block (a NumPy vector) from the :class:`Sums` over
        every process, at the step's global batch ``batch`` (``None``: not
        known, taken as :data:`REFERENCE_BATCH`)."""
        raise NotImplementedError

    def __repr__(self):
        return repr(self.name)


class Natural(StepRule):
    """``ρ_b = 1``: the natural-gradient step ``η F̂⁻¹ g``."""

    name = 'natural'

    def scales(self, sums, batch=None):
        return numpy.ones(len(sums.vg))


def grafted(vv, gg):
    """``sqrt(gg / vv)`` per block, ``1`` where ``vv`` is 0: the scale that
    gives ``V`` (``⟨V, V⟩ = vv``) the length of ``g`` (``⟨g, g⟩ = gg``)."""
    # A zero V (a zero gradient) stays zero: nothing to lengthen.
    safe = numpy.where(vv > 0, vv, 1.0)
    return numpy.where(vv > 0, numpy.sqrt(gg / safe), 1.0)


class KLGraft(StepRule):
    """``ρ_b = sqrt((B / B₀) Σ_c (‖g_c‖² / ‖V_c‖²) ⟨V_c, g_c⟩ / Σ_c ⟨V_c,
    g_c⟩)`` for every block ``b``: the natural direction, as long in KL
    change as layer-wise grafting's step times ``B / B₀``."""

    name = 'kl_graft'

    def scales(self, sums, batch=None):
        grown = batch_ratio(batch)
        total = sums.vg.sum()
        if not total > 0:
            return numpy.full(len(sums.vg), math.sqrt(grown))
        rho = grafted(sums.vv, sums.gg)
        return numpy.full(len(sums.vg), numpy.sqrt(
            grown * (rho ** 2 * sums.vg).sum() / total))


def kl_estimate(rho, sums, lr, loss_scale=None):
    """``q = η² Σ_b ρ_b² ⟨V_b, g_b⟩ / s²`` from the scales ``rho`` and the
    :class:`Sums`."""
    q = lr * lr * float(rho * rho @ sums.vg)
    if loss_scale is not None:
        q /= loss_scale * loss_scale
    return q


def scale(q, bound):
    """``ν = min(1, sqrt(κ / q))``; 1 when the bound is off (``None``) or
    ``q`` is not positive."""
    if bound is None or not q > 0:
        return 1.0
    return min(1.0, math.sqrt(bound / q))


class Length(typing.NamedTuple):
    """The step's length: every block's step is ``−η ν ρ_b V_b``."""

    #: ``ρ``, the rule's scale per block.
    rho: numpy.ndarray
    #: ``ν``, the bound's.
    nu: float
    #: ``q``, the KL estimate of the step before ``ν``.
    kl: float

    def report(self):
        """The ``kfac/`` values of the reporting guide it gives."""
        return {'kfac/kl': self.kl, 'kfac/update_scale': self.nu,
                'kfac/step_scale': typical(self.rho)}


def length(rule, sums, lr, bound, loss_scale=None, batch=None):
    """The :class:`Length` of the step by ``rule`` from the :class:`Sums`
    ``sums`` at learning rate ``lr``, bound ``κ_t`` ``bound`` (``None``:
    off) and global batch ``batch``, the gradients carrying
    ``loss_scale``."""
    rho = rule.scales(sums, batch)
    q = kl_estimate(rho, sums, lr, loss_scale)
    return Length(rho, scale(q, bound), q)


class Bound:
    """``κ_t = kl_clip · (B / B₀) · (η_t / η̂_t)²``: the bound at the
    step's global batch and learning rate. ``η̂_t`` is kept in
    snapshots."""

    def __init__(self, reference_lr):
        #: ``η̂_t``, the largest learning rate so far.
        self.peak = float(reference_lr)

    def __call__(self, kl_clip, lr, batch=None):
        """``κ_t`` at learning rate ``lr``, which joins ``η̂_t``, and global
        batch ``batch`` (``None``: not known, taken as ``B₀``); ``None``
        when ``kl_clip`` is. ``η̂_t`` depends on the schedule alone, so a
        step skipped afterwards still counts in it."""
        self.peak = max(self.peak, lr)
        if kl_clip is None:
            return None
        grown = kl_clip * batch_ratio(batch)
        if not self.peak > 0:
            return grown  # no step yet: q is 0 too
        return grown * (lr / self.peak) ** 2

    def serialize(self, serializer):
        """Saves or loads ``η̂_t``."""
        self.peak = float(serializer('peak_lr', self.peak))


RULES = {rule.name: rule for rule in (KLGraft, Natural)}
#: The rule ``KFAC`` takes unless told otherwise.
DEFAULT = KLGraft.name


def register(rule):
    """Adds the :class:`StepRule` class ``rule`` to :data:`RULES` under its
    ``name`` (the optimizer's own rules, such as
    :class:`chainerkfac.optimizers.quadratic_model.QuadraticModel`, which
    runs forward passes of the model)."""
    RULES[rule.name] = rule
    return rule


def get(value):
    """The :class:`StepRule` the ``step_rule`` option names (a name in
    :data:`RULES` or a :class:`StepRule`)."""
    if isinstance(value, StepRule):
        return value
    if value not in RULES:
        raise ValueError('KFAC step_rule must be one of {} or a StepRule, '
                         'got {!r}'.format(', '.join(map(repr, RULES)),
                                           value))
    return RULES[value]()
