"""The step rule: how long each K-FAC block's step is.

Preconditioning gives every block ``b`` a direction ``V_b = F̂_b⁻¹ g_b``
(``g_b`` the gradient the block preconditioned: optimizer hooks such as
``WeightDecay`` and K-FAC's own ``weight_decay`` term included). A step rule
rescales it, ``V_b <- ρ_b V_b``, before the update rule's
``v <- μ v − η V; w <- w + v``. Its inputs are three sums per block, which
the stages add over processes in the all-gather the step already makes
(:meth:`Stages.gather <chainerkfac.optimizers.stages.Stages.gather>`), so
that every process computes the same ``ρ``::

    ⟨V_b, g_b⟩    ⟨V_b, V_b⟩    ⟨g_b, g_b⟩    ⟨g_b, V_b,t−1⟩

(the last one, with the block's previous direction, for a rule that keeps
it, :meth:`StepRule.directions`; 0 otherwise).

The update-norm guard
(:mod:`chainerkfac.update_norm`) then bounds what the rule chose.

Rules (the ``step_rule`` option of :class:`~chainerkfac.optimizers.KFAC`):

* :class:`Graft` (``'graft'``): layer-wise learning-rate
  grafting (Agarwal, Anil, Hazan, Koren & Zhang 2020, "Disentangling
  adaptive gradient methods from learning rates", §3: the magnitude of one
  method, the direction of another, per layer). Each block keeps K-FAC's
  direction and takes the length of its gradient::

      ρ_b = ‖g_b‖ / ‖V_b‖

  so that ``η ρ_b V_b`` is exactly as long as plain SGD's step ``η g_b`` at
  the same learning rate, block by block. Grafting happens before
  momentum (as Distributed Shampoo grafts): one momentum buffer
  accumulates grafted steps, as MomentumSGD's accumulates gradients. The
  learning rate and its schedule then set the step as they do for
  MomentumSGD; the curvature and the damping only turn it.
* :class:`Natural` (``'natural'``): ``ρ_b = 1``, the natural-gradient step
  ``η F̂⁻¹ g``, whose length the learning rate, the curvature and the
  damping set together (and the guard, where it binds).
* :class:`KLGraft` (``'kl_graft'``): the natural step's
  direction over all blocks together, with the KL change of the grafted
  step: one scale for every block, ::

      ρ² = Σ_b (‖g_b‖² / ‖V_b‖²) ⟨V_b, g_b⟩ / Σ_b ⟨V_b, g_b⟩

  so that ``½ η² Σ_b ρ² ⟨V_b, g_b⟩``, the step's KL change
  (:mod:`chainerkfac.update_norm`), equals that of :class:`Graft`'s step.
  The learning rate keeps grafting's units, while the curvature divides
  the step among the layers as the natural step does. Where the guard
  binds, the step is then ``F̂⁻¹ g`` scaled to the bound's KL change: of
  all steps with that KL change, the one whose first-order decrease of
  the loss is largest (Amari 1998, as Ba et al. 2017 §2.2 restate it),
  where a shortened grafted step spends the same KL change on a worse
  direction.
* :class:`GraftAverage` (``'graft_average'``, the default): :class:`Graft`
  of running averages of the sums::

      ρ_b = sqrt(m_t(‖g_b‖²) / m_t(‖V_b‖²)),
      m_t(x) = δ m_{t−1}(x) + (1 − δ) x_t,    m_1(x) = x_1,  δ = 0.99

  Each layer's step is as long as SGD's over about the last
  ``1 / (1 − δ)`` steps, while from one step to the next its length moves
  with ``‖V_b‖``, as the natural step's does, where grafting each step's
  norms fixes it to SGD's. The averages are the rule's state, kept in
  snapshots and started afresh after a backtrack.
* :class:`NoiseCap` (``'noise_cap'``): :class:`GraftAverage`, each
  block's step no longer than the natural step at the learning rate the
  gradient's noise allows::

      ρ_b = min(ρ_b^avg, (1 − μ) α̂ / η),
      α̂ = max(0, m_t(Σ_b ⟨g_b,t, V_b,t−1⟩)) / m_t(Σ_b ⟨V_b,t, g_b,t⟩)

  In the quadratic model of the loss with ``F̂`` for its curvature, a step
  ``−α F̂⁻¹g`` along a gradient ``g = ḡ + ξ`` with independent noise ``ξ``
  lowers the loss most, in expectation, at ``α* = ḡᵀF̂⁻¹ḡ / E[gᵀF̂⁻¹g]``,
  the fraction of ``⟨V, g⟩`` that is signal. A step's noise is
  independent of the last step's, so ``⟨g_t, V_{t−1}⟩`` estimates the
  numerator (and, where steps overshoot, turns negative and shortens
  them). Momentum ``μ`` multiplies a steady step by ``1 / (1 − μ)``,
  hence the cap's factor. Where the cap binds, the step is the natural
  step at the learning rate the run measures; where the user's
  learning rate asks for less (warm-up, the end of a decay), grafting's
  length stands. The averages (decay ``δ``) and the last directions are
  the rule's state, kept in snapshots; it costs a copy of the
  blocks' preconditioned gradients and one inner product per block a
  step.

A block without an inverse yet has ``V_b = g_b`` and ``ρ_b = 1`` under
every rule.
"""
import chainer
from chainer import backend
import numpy

#: The per-block sums, in their order in the gathered terms.
TERMS = ('vg', 'vv', 'gg', 'g_last')
N_TERMS = len(TERMS)


def _with_last(xp, g, last, sums):
    """``sums`` and, with ``last``, ``⟨g, last⟩`` (``last`` a NumPy array
    after a snapshot where ``g`` may be CuPy's), as one array."""
    if last is not None:
        sums.append(xp.vdot(g, xp.asarray(last, dtype=g.dtype).ravel()))
    return xp.stack(sums)


def block_terms(preconditioned, gradient, last=None):
    """``[⟨V, g⟩, ⟨V, V⟩, ⟨g, g⟩, ⟨g, last⟩]`` for one block (or one part
    of a block: they add over parts; ``last`` its previous direction),
    as one array of the arrays' module (read back once per step, not once
    per block). Without ``last`` the row stops at ``⟨g, g⟩``, and
    :func:`stack_terms` puts 0 in its place."""
    xp = backend.get_array_module(gradient)
    V, g = preconditioned.ravel(), gradient.ravel()
    return _with_last(xp, g, last, [xp.vdot(V, g), xp.vdot(V, V),
                                    xp.vdot(g, g)])


def identity_terms(gradient, last=None):
    """:func:`block_terms` of a block without an inverse (``V = g``,
    ``F̂ = I``): ``⟨g, g⟩`` three times, then ``⟨g, last⟩``."""
    xp = backend.get_array_module(gradient)
    g = gradient.ravel()
    gg = xp.vdot(g, g)
    return _with_last(xp, g, last, [gg, gg, gg])


def stack_terms(rows):
    """The rows of :func:`block_terms` as one ``(blocks, N_TERMS)`` array
    (a NumPy one without blocks), 0 for the last sum of a row without
    it."""
    if not rows:
        return numpy.zeros((0, N_TERMS))
    xp = backend.get_array_module(rows[0])
    short = [len(row) < N_TERMS for row in rows]
    if not any(short):
        return xp.stack(rows)
    if all(short):
        # Every rule but noise_cap: one zero column for the step, not a
        # zero array per block.
        stacked = xp.stack(rows)
        return xp.concatenate(
            [stacked, xp.zeros((len(rows), 1), dtype=stacked.dtype)], axis=1)
    return xp.stack([xp.concatenate([row, xp.zeros(1, dtype=row.dtype)])
                     if is_short else row
                     for row, is_short in zip(rows, short)])


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
    changed K-FAC's natural step (below 1 under grafting: the natural
    step is longer than SGD's)."""
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
    #: and ``after_update`` around the step, and the guard is off (the
    #: rule's ``α`` would undo it).
    chooses_update = False

    def directions(self):
        """The blocks' previous directions ``V_b,t−1`` (a list in the
        blocks' order, each in its block's layout or ``None``), with which
        the stages take the sums' last one, or ``None`` (only
        :class:`NoiseCap` keeps them)."""
        return None

    def observe(self, blocks, hyperparam):
        """Called just before :meth:`scales`, where every process holds
        every block's ``V`` (``blocks[b].gradient()``), with the step's
        hyperparameters. Only :class:`NoiseCap` looks."""

    def scales(self, terms):
        """``ρ`` per block (a NumPy vector) from ``terms``, a NumPy array
        ``(blocks, N_TERMS)`` of the sums over every process."""
        raise NotImplementedError

    def forget(self):
        """Drops what the rule kept of the run's steps, as after a
        backtrack (:mod:`chainerkfac.backtrack`), which undid the last of
        them (nothing but :class:`GraftAverage`'s averages and
        :class:`NoiseCap`'s signal and directions)."""

    def serialize(self, serializer):
        """Saves or loads the rule's state between steps (none but
        :class:`GraftAverage`'s)."""

    def __repr__(self):
        return repr(self.name)


class Natural(StepRule):
    """``ρ_b = 1``: the natural-gradient step ``η F̂⁻¹ g``."""

    name = 'natural'

    def scales(self, terms):
        return numpy.ones(len(terms))


def grafted(vv, gg):
    """``sqrt(gg / vv)`` per block, ``1`` where ``vv`` is 0: the scale that
    gives ``V`` (``⟨V, V⟩ = vv``) the length of ``g`` (``⟨g, g⟩ = gg``)."""
    # A zero V (a zero gradient) stays zero: nothing to lengthen.
    safe = numpy.where(vv > 0, vv, 1.0)
    return numpy.where(vv > 0, numpy.sqrt(gg / safe), 1.0)


class Graft(StepRule):
    """``ρ_b = ‖g_b‖ / ‖V_b‖``: SGD's step length per block, K-FAC's
    direction (Agarwal et al. 2020)."""

    name = 'graft'

    def scales(self, terms):
        return grafted(terms[:, 1], terms[:, 2])


class KLGraft(StepRule):
    """``ρ_b = sqrt(Σ_c (‖g_c‖² / ‖V_c‖²) ⟨V_c, g_c⟩ / Σ_c ⟨V_c, g_c⟩)``
    for every block ``b``: the natural direction, as long in KL change as
    :class:`Graft`'s step."""

    name = 'kl_graft'

    def scales(self, terms):
        vg = terms[:, 0]
        total = vg.sum()
        if not total > 0:
            return numpy.ones(len(terms))
        rho = grafted(terms[:, 1], terms[:, 2])
        return numpy.full(len(terms),
                          numpy.sqrt((rho ** 2 * vg).sum() / total))


class GraftAverage(StepRule):
    """``ρ_b = sqrt(m_t(‖g_b‖²) / m_t(‖V_b‖²))``, ``m_t`` running averages
    of decay :attr:`decay`: :func:`grafted` of the averages."""

    name = 'graft_average'
    #: ``δ``: the averages span about the last ``1 / (1 − δ)`` steps.
    decay = 0.99

    def __init__(self):
        #: ``(blocks, 2)``: ``m_t(‖V_b‖²)``, ``m_t(‖g_b‖²)``; ``None``
        #: before the first step.
        self.averages = None

    def scales(self, terms):
        norms = numpy.asarray(terms, dtype=float)[:, 1:3]
        if self.averages is None or self.averages.shape != norms.shape:
            self.averages = norms.copy()
        else:
            self.averages = (self.decay * self.averages
                             + (1 - self.decay) * norms)
        return grafted(self.averages[:, 0], self.averages[:, 1])

    def forget(self):
        """Starts the averages afresh at the next step: those of the steps a
        backtrack undid would keep the next steps as long as theirs."""
        self.averages = None

    def serialize(self, serializer):
        """Saves or loads the averages (a snapshot without them starts
        them afresh at the next step)."""
        if not isinstance(serializer, chainer.serializer.Deserializer):
            serializer('averages', numpy.zeros((0, 2))
                       if self.averages is None else self.averages)
            return
        try:
            value = serializer('averages', None)
        except KeyError:
            value = None  # written under another rule
        value = None if value is None else numpy.asarray(value, float)
        self.averages = value if value is not None and value.size else None


def _direction(block):
    """A copy of ``block``'s ``V`` in its layout, or ``None`` for a block
    without parameters or gradients yet."""
    if not block.shaped() or any(p.grad is None for p in block.params()):
        return None
    return block.gradient().copy()


class NoiseCap(GraftAverage):
    """:class:`GraftAverage`'s ``ρ_b``, at most ``(1 − μ) α̂ / η``, ``α̂``
    the signal fraction of the natural step's ``⟨V, g⟩`` that the next
    step's gradient confirms (running averages of decay :attr:`decay`)."""

    name = 'noise_cap'

    def __init__(self):
        super().__init__()
        #: ``[m_t(Σ_b ⟨V_b, g_b⟩), m_t(Σ_b ⟨g_b, V_b,t−1⟩)]`` (from zero),
        #: or ``None`` before the first step with a previous direction.
        self.signal = None
        #: The previous step's ``V`` of each block, or ``None``.
        self.last = None
        self._next = None
        self._factor = None

    def directions(self):
        return self.last

    def observe(self, blocks, hyperparam):
        self._next = [_direction(block) for block in blocks]
        self._factor = (1 - hyperparam.momentum) / hyperparam.lr \
            if hyperparam.lr > 0 else None

    def scales(self, terms):
        rho = super().scales(terms)
        had_last = self.last is not None and len(self.last) == len(terms)
        self.last = self._next
        if not had_last:
            return rho
        sums = numpy.array([terms[:, 0].sum(), terms[:, 3].sum()])
        # From zero: a ratio of averages needs no correction of their
        # bias, while starting at the first sums would let that one step
        # set the cap for the next ~1 / (1 − δ).
        self.signal = (0 if self.signal is None else
                       self.decay * self.signal) + (1 - self.decay) * sums
        if not self.signal[0] > 0 or self._factor is None:
            return rho
        fraction = max(self.signal[1], 0.0) / self.signal[0]
        chainer.report({'kfac/signal_fraction': fraction})
        return numpy.minimum(rho, self._factor * fraction)

    def forget(self):
        """Starts the averages, the signal's among them, afresh and drops
        the previous directions: the first step after it is not capped."""
        super().forget()
        self.signal = self.last = None

    def serialize(self, serializer):
        """Saves or loads the averages and the previous directions (a
        snapshot without them starts them afresh: the first step after it
        is not capped)."""
        super().serialize(serializer)
        if not isinstance(serializer, chainer.serializer.Deserializer):
            serializer('signal', numpy.zeros(0) if self.signal is None
                       else self.signal)
            last = self.last or ()
            serializer('last_blocks', numpy.array(
                [v is not None for v in last], dtype=bool))
            for i, v in enumerate(last):
                if v is not None:
                    serializer('last_{}'.format(i), v)
            return
        try:
            signal = numpy.asarray(serializer('signal', None), float)
            present = numpy.asarray(serializer('last_blocks', None), bool)
            last = [serializer('last_{}'.format(i), None) if here else None
                    for i, here in enumerate(present)]
        except KeyError:
            signal, last = numpy.zeros(0), []
        self.signal = signal if signal.size else None
        self.last = last or None


RULES = {rule.name: rule for rule in (Graft, Natural, KLGraft, GraftAverage,
                                      NoiseCap)}
#: The rule ``KFAC`` takes unless told otherwise.
DEFAULT = GraftAverage.name


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
