"""The life-cycle every Fisher block shares.

One block per supported link owns all K-FAC state of that link::

    hooks:      forward_statistics(x) ... backward_statistics(ctx, gy, node)
                   (only on steps where a factor is due; sums per sample)
    optimizer:  take_statistics()      -> batch means of the due factors
                update_factors(step)   -> C <- d C + (1 - d) C_new
                update_inverse(step)   -> form = family.build(factors, ε)
                direction()            -> (form.apply(∇), ∇)
                set_gradient(V)        -> param.grad <- V

Damping is applied only when building the inverse form
(:mod:`chainerkfac.curvature.forms`; the formulas in
:mod:`chainerkfac.linalg`); the stored statistics never contain it.
"""
import collections
import dataclasses
import logging

from chainer import backend

from chainerkfac import background
from chainerkfac import schedules
from chainerkfac.curvature import block_state
from chainerkfac.curvature import cost
from chainerkfac.curvature import families
from chainerkfac.curvature import statistics


#: Where links that get less curvature than the options ask for are named
#: (momentum SGD at setup; a lazily initialised Linear that keeps ``A ⊗ G``
#: at its first input); ``logging.getLogger('chainerkfac.fallback')
#: .setLevel(logging.ERROR)`` silences it.
fallback_logger = logging.getLogger('chainerkfac.fallback')


class NonFiniteError(FloatingPointError):
    """A gradient or a curvature factor holds NaN or Inf."""


#: What the optimizer tells every block at construction.
#: ``factor_intervals`` maps ``'A'`` (forward statistics) and ``'G'``
#: (backward statistics) to an interval (see :mod:`chainerkfac.schedules`);
#: the others are the :class:`~chainerkfac.optimizers.KFAC` options of the
#: same names.
BlockOptions = collections.namedtuple(
    'BlockOptions',
    ['factor_intervals', 'inverse_interval', 'inverse', 'bn_fisher',
     'spatial_subsample', 'batch_subsample', 'conv_factors',
     'doubly_factored_from'])


class FisherBlock(statistics.StatisticsSums, block_state.SnapshotState):
    """Base class of the Fisher blocks; subclasses define the factors.

    Attributes:
        link: The link whose parameters the block preconditions.
        name (str): The link's path in the model (e.g. ``'res2/conv1'``).
        factors (tuple of str): Names of the statistics the block keeps.
        family (:class:`~chainerkfac.curvature.families.Family`): The inverse
            forms the block may hold and how a refresh builds one.
        form (:class:`~chainerkfac.curvature.forms.Form`): The current
            damped inverse, or ``None`` before the first.
    """

    #: Names of the stored statistics.
    factors = ()
    #: The factors that come from the forward pass (refreshed on the
    #: ``factor_intervals['A']`` schedule); the others come from the
    #: backward pass (``factor_intervals['G']``).
    forward_factors = ('A',)

    def __init__(self, link, name, options):
        self.link = link
        self.name = name
        self.family = self.form_family(options)
        self.form = None
        self.schedules = {f: schedules.RefreshSchedule(
            options.factor_intervals[
                'A' if f in self.forward_factors else 'G'])
            for f in self.factors}
        self.inverse_schedule = schedules.RefreshSchedule(
            options.inverse_interval)
        self.factor = dict.fromkeys(self.factors)
        #: An inverse being built off the critical path
        #: (:mod:`chainerkfac.background`): ``(step it takes effect, a
        #: Future or the form)``, or ``None``.
        self.pending = None
        #: The sums of each factor's statistics, kept from refresh to
        #: refresh (:meth:`statistics_out`).
        self._sum = dict.fromkeys(self.factors)
        self._count = dict.fromkeys(self.factors, 0)
        self._factors_changed = False
        #: Rows (samples times positions) of the last training pass, for
        #: the cost of a step (:meth:`step_work`); 0 before the first.
        self.pass_rows = 0

    def form_family(self, options):
        """The :class:`~chainerkfac.curvature.families.Family` the
        :class:`BlockOptions` give this block (called once, by
        ``__init__``, once :attr:`link` is set)."""
        raise NotImplementedError

    def fix_form(self, build):
        """Makes every refresh build its form with ``build(factors,
        damping, reuse)``, one of the family's kinds: the distributed
        stages fix the form of a block whose preconditioning they split
        over ranks, as the split depends on it
        (:mod:`chainerkfac.distributed.split`)."""
        self.family = families.Family(self.family.kinds, build,
                                      self.family.damping)

    @classmethod
    def unsupported_reason(cls, link):
        """Why ``link`` cannot get this block, or ``None`` if it can."""
        return None

    @classmethod
    def for_link(cls, link, options):
        """The block class that serves ``link`` under ``options``: this
        one, or a variant a block type chooses by the link's shape (a
        Linear with a large input, :mod:`chainerkfac.curvature.linear`)."""
        return cls

    def params(self):
        """The parameters this block preconditions, in gradient order."""
        raise NotImplementedError

    def shaped(self):
        """Whether the block's parameters exist (a lazily initialised link
        gets them at its first forward pass; until then the block holds
        nothing and costs nothing)."""
        return all(p.array is not None for p in self.params())

    def frozen(self):
        """Whether every parameter's update is disabled
        (``Link.disable_update``): the block takes no step."""
        return all(p.update_rule is not None and not p.update_rule.enabled
                   for p in self.params())

    def shapes_known(self):
        """Whether :meth:`describe` gives the shapes of the block's state
        (what a snapshot's header is checked against): once
        :meth:`shaped`, unless the block takes more from its first input."""
        return self.shaped()

    # -- statistics (called by the link hooks) ---------------------------

    def wanted(self, step):
        """The factors whose statistics step ``step`` must collect."""
        return [f for f in self.factors if self.schedules[f].due(step)]

    def forward_statistics(self, x, wanted):
        """Accumulates forward statistics of input ``x``; returns a context
        for :meth:`backward_statistics` (``None``: none wanted)."""
        raise NotImplementedError

    def backward_statistics(self, context, gy, node):
        """Accumulates backward statistics of the output gradient ``gy``;
        ``node``, the function node of the link's output, holds what its
        forward computed (BatchNormalization's batch moments)."""
        raise NotImplementedError

    def gradient_loss_scale(self):
        """The loss scale the block's gradients (and so its backward
        statistics) were computed with, or ``None``: what ``backward``
        recorded on the parameters (a manual loop's
        ``loss.backward(loss_scale=s)`` too), in the private attribute
        Chainer's own update rules read."""
        return self.params()[0]._loss_scale

    # -- factors and inverses (called by the optimizer) ------------------

    def update_factors(self, step, stats, decay):
        """Folds new statistics into the stored factors.

        ``C <- decay * C + (1 - decay) * C_new`` (``decay`` weighs the *old*
        value; the first statistics are taken as they are). Returns
        ``{factor: change rate}`` for the refreshed factors, the rate being
        ``‖C_t − C_{t−Δ}‖_F / ‖C_{t−Δ}‖_F`` (``None`` on a first refresh).
        """
        rates = {}
        for f, new in stats.items():
            xp = backend.get_array_module(new)
            if not bool(xp.isfinite(new).all()):
                raise NonFiniteError(
                    'non-finite value in the {} factor of {} at iteration {}'
                    .format(f, self.name, step))
            old = self.factor[f]
            rate = None
            old_norm = 0 if old is None else float(xp.linalg.norm(old))
            if old is not None and decay:
                # In place, as C + (1 - d)(C_new - C): factor-sized
                # temporaries would be fresh memory on every refresh.
                # ‖C_t − C_{t−Δ}‖ = (1 - d) ‖C_new − C_{t−Δ}‖.
                new -= old
                new *= 1 - decay
                if old_norm > 0:
                    rate = float(xp.linalg.norm(new)) / old_norm
                old += new
            else:
                if old_norm > 0:
                    rate = float(xp.linalg.norm(new - old)) / old_norm
                if new is self._sum[f]:
                    # The factor takes the sum's array (whoever holds the
                    # previous factor keeps it as it was).
                    self._sum[f] = None
                    self.factor[f] = new
                else:
                    # A view would keep a whole receive buffer alive.
                    self.factor[f] = new if new.base is None else new.copy()
            rates[f] = rate
            self.schedules[f].mark(step, rate)
            self._factors_changed = True
        return rates

    def inverse_due(self, step, damping):
        """Whether step ``step`` must recompute the inverse: every factor
        exists, a factor or the damping changed since the last inverse, the
        inverse schedule is due, and no inverse is on its way."""
        used = None if self.form is None else self.form.damping
        return (all(self.factor[f] is not None for f in self.factors)
                and (self._factors_changed or damping != used)
                and self.inverse_schedule.due(step)
                and self.pending is None)

    def update_inverse(self, step, damping, delay=0):
        """Recomputes the damped inverse if :meth:`inverse_due`.

        With ``delay`` d > 0 and an inverse already in place, the new one
        is built in the background from the factors as they are now and
        takes effect at step ``step + d`` (:meth:`take_pending`;
        :mod:`chainerkfac.background`). Returns whether a new inverse took
        effect now.
        """
        if not self.inverse_due(step, damping):
            return False
        factors = tuple(self.factor[f] for f in self.factors)
        if delay and self.form is not None:
            # In effect from step + delay until the next one, built no
            # sooner than then: it serves at least ``delay`` steps.
            self.pending = step + delay, background.submit(
                self.family.build, factors, damping,
                max(self.inverse_reuse(step), delay))
        else:
            self.form = self.family.build(factors, damping,
                                          self.inverse_reuse(step))
        self.inverse_schedule.mark(step)
        self._factors_changed = False
        return self.pending is None

    def take_pending(self, step):
        """Puts in place the inverse built in the background once step
        ``step`` is the one it takes effect at (waiting for it if need
        be); returns whether it did."""
        if self.pending is None or step < self.pending[0]:
            return False
        self.form = background.result(self.pending[1])
        self.pending = None
        return True

    def __getstate__(self):
        # A pickle or a deep copy holds the pending inverse itself, not the
        # worker's Future.
        state = dict(self.__dict__)
        if self.pending is not None:
            state['pending'] = (self.pending[0],
                                background.result(self.pending[1]))
        return state

    def effective_damping(self, hyperparam):
        """The damping this block's inverse is built with (the family's
        policy, :mod:`chainerkfac.linalg`)."""
        return self.family.damping(hyperparam)

    def inverse_reuse(self, step=None):
        """Steps an inverse computed at ``step`` is expected to serve: the
        inverse interval, or the shortest factor interval if longer (an
        inverse is only recomputed after a factor changed); ``step=None``:
        the first iteration of a fresh run (the options alone)."""
        def interval(schedule):
            return schedule.initial_interval() if step is None else \
                schedule.current_interval(step)
        return max([interval(self.inverse_schedule)]
                   + [min(interval(self.schedules[f])
                          for f in self.factors)])

    # -- gradients ------------------------------------------------------

    def gradient(self, weight_decay=0.0):
        """The block's gradient in the layout its factors act on.

        ``weight_decay`` η adds ``η w`` for the weights the block decays
        (Osawa et al. §4.2: the L2 term's gradient, preconditioned with the
        rest; its curvature η is added to the damping by the optimizer).
        """
        raise NotImplementedError

    def set_gradient(self, grad):
        """Writes a gradient in the block's layout back into ``param.grad``."""
        raise NotImplementedError

    def splittable(self):
        """Whether the preconditioning can be split over ranks by rows or
        columns of ``V`` (:mod:`chainerkfac.distributed.split`)."""
        return False

    def ready(self):
        """Whether an inverse exists: the block can precondition."""
        return self.form is not None

    def holds_curvature(self):
        """Whether this process holds any of the block's curvature (a
        factor or an inverse): in a distributed run, its owner."""
        return self.form is not None or any(
            self.factor[f] is not None for f in self.factors)

    def clear_curvature(self):
        """Drops the factors and the inverse, as a process that does not
        own the block holds none (after they moved to their owner). The
        current step's statistics stay: every process collects them for
        every block (a resume moves curvature after the first backward)."""
        self.factor = dict.fromkeys(self.factors)
        self._sum = {f: self._sum[f] if self._count[f] else None
                     for f in self.factors}
        self.form = None
        self.pending = None

    def note_pass(self, x):
        """Records the rows of a training pass with input ``x`` (its
        samples; a Kronecker block's times its positions)."""
        self.pass_rows = len(x)

    def step_work(self, acc_iters=1, low_rank=True):
        """The :class:`~chainerkfac.curvature.cost.StepWork` of a step of
        ``acc_iters`` training passes like the last: the layer's forward
        and backward passes, K-FAC's stale and refresh steps
        (:meth:`BlockCost.step_costs
        <chainerkfac.curvature.cost.BlockCost.step_costs>`; ``low_rank``
        whether the step may precondition from its rows), or ``None``
        without a cost or before the first training pass."""
        block_cost = self.cost()
        if block_cost is None or not self.pass_rows:
            return None
        block_cost = dataclasses.replace(
            block_cost, rows=self.pass_rows * acc_iters,
            low_rank=block_cost.low_rank and low_rank)
        return cost.StepWork(block_cost.pass_cost(),
                             *block_cost.step_costs())

    def keeps_rows(self, x):
        """Whether a training pass with input ``x`` keeps its rows for a
        cheaper exact product (:mod:`chainerkfac.curvature.low_rank`;
        only a Linear's block does)."""
        return False

    def scale_rows(self, factor):
        """The kept rows' gradient was scaled by ``factor`` (see
        :meth:`keeps_rows`)."""

    def clear_rows(self):
        """Drops the rows kept since the last step."""

    def apply_form(self, grad):
        """``V = F̂⁻¹ grad`` by the block's form."""
        return self.form.apply(grad)

    def direction(self, weight_decay=0.0):
        """``(V, ∇)``: the preconditioned gradient ``V = F̂⁻¹ ∇`` and the
        gradient ``∇`` it came from (``weight_decay``'s term included), as
        :meth:`gradient` lays them out; :meth:`set_gradient` then puts
        ``V`` in the parameters' gradients. Before its first inverse a
        block keeps its raw gradient (``F̂ = I``): ``V`` is ``∇``, without
        the decay term."""
        if not self.ready():
            grad = self.gradient()
            return grad, grad
        grad = self.gradient(weight_decay)
        return self.apply_form(grad), grad

    # -- description and serialisation -----------------------------------

    def describe(self):
        """A short description for :meth:`KFAC.describe`."""
        return type(self).__name__

    def cost(self):
        """The block's :class:`~chainerkfac.distributed.BlockCost`, for the
        layer-to-rank cost model, or ``None``: a custom block used in a
        distributed run overrides this; in one process, a block without it
        is taken to be small (see :mod:`chainerkfac.cpu_parallel`)."""
        return None

    def state_bytes(self):
        """Bytes held by the stored factors, inverses and the sums kept for
        the next statistics (:meth:`statistics_out`)."""
        arrays = list(self.factor.values()) + list(self._sum.values())
        return sum(a.nbytes for a in arrays if a is not None) + (
            0 if self.form is None else self.form.nbytes)
