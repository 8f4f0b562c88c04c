"""K-FAC: the optimizer that replaces ``chainer.optimizers.MomentumSGD``.

One step (Osawa et al. CVPR 2019, Algorithm 1, single process)::

    forward/backward        link hooks collect A and G on refresh steps only
    optimizer hooks 'pre'   e.g. WeightDecay, GradientClipping
    curvature               C <- d C + (1 - d) C_new; damped inverses when due
    precondition            V <- F̂⁻¹ ∇ for every supported link
    step rule               V <- ρ V per link (grafting: SGD's length);
                            the update-norm guard, if on, bounds it
    update rule             v <- momentum v - lr V;  w <- w + v
    optimizer hooks 'post'

Parameters of links without a Fisher block keep their raw gradient and so
follow plain momentum SGD.
"""
import logging

import chainer
from chainer import optimizer
from chainer.optimizers import momentum_sgd

from chainerkfac import cpu_parallel
from chainerkfac import divergence as divergence_module
from chainerkfac import hooks
from chainerkfac import schedules
from chainerkfac import step_rule as step_rule_module
from chainerkfac import timing as timing_module
from chainerkfac import update_norm
from chainerkfac.curvature import base
from chainerkfac.curvature import registry
from chainerkfac.optimizers import accumulation
from chainerkfac.optimizers import nonfinite
from chainerkfac.optimizers import options
from chainerkfac.optimizers import quadratic_model  # NOQA  (its rule)
from chainerkfac.optimizers import snapshot
from chainerkfac.optimizers import stages as stages_module

logger = logging.getLogger(__name__)

_default_hyperparam = optimizer.Hyperparameter()
_default_hyperparam.lr = 0.01
_default_hyperparam.momentum = 0.9
_default_hyperparam.damping = 1e-2
_default_hyperparam.cov_ema_decay = 0.95
_default_hyperparam.weight_decay = 0.0
_default_hyperparam.bn_damping_multiplier = 1.0
_default_hyperparam.kl_clip = 1e-2


class KFACUpdateRule(momentum_sgd.MomentumSGDRule):
    """``v <- momentum v - lr ∇;  w <- w + v`` on the preconditioned gradient.

    The arithmetic is MomentumSGD's, operation for operation, so that a link
    without curvature is updated exactly as MomentumSGD would update it.
    """


class KFAC(nonfinite.FiniteChecks, optimizer.GradientMethod):
    """K-FAC with momentum (Martens & Grosse 2015; Osawa et al. CVPR 2019).

    Swap it in for MomentumSGD; :meth:`setup` finds every Linear,
    Convolution2D and BatchNormalization link (and links registered with
    :func:`chainerkfac.curvature.register`) and preconditions their
    gradients; all other parameters get momentum SGD.

    Args:
        lr (float): Learning rate η: ``v <- momentum v - η ρ F̂⁻¹∇``, with
            the step rule's scale ``ρ`` per block; under the default
            grafted step each layer's step is as long as MomentumSGD's at
            the same learning rate, so its value and schedule carry over.
        momentum (float): Momentum coefficient; 0 gives
            ``w <- w - η ρ F̂⁻¹∇``.
        step_rule (str or :class:`~chainerkfac.step_rule.StepRule`): How
            long each block's step is (:mod:`chainerkfac.step_rule`):
            ``'graft'`` (default) K-FAC's direction with the length of the
            block's gradient, ``ρ_b = ‖∇_b‖ / ‖F̂_b⁻¹∇_b‖`` (learning-rate
            grafting, Agarwal et al. 2020); ``'natural'`` the
            natural-gradient step ``η F̂⁻¹∇`` (the default before
            grafting); ``'adaptive'`` the natural direction with
            its length, the momentum and the damping chosen by the loss's
            quadratic model at every step (Martens & Grosse 2015 §6-7,
            :mod:`chainerkfac.optimizers.quadratic_model`): ``lr`` and
            ``momentum`` are then not used, ``damping`` is the first
            ``λ``, the guard is off; it needs ``update(classifier, x, t)``
            with a ``chainer.links.Classifier`` of softmax cross-entropy.
        damping (float): Tikhonov damping ε (see :mod:`chainerkfac.linalg`
            for how each inverse applies it).
        cov_ema_decay (float): Weight of the *old* statistics in
            ``C <- d C + (1 - d) C_new``; 0 keeps fresh statistics only.
        inverse (str): ``'cholesky'`` (factored damping with π; explicit
            inverses, or Cholesky factors for inverses used for few steps)
            or ``'eigen'`` (eigendecompositions, exact damping).
        bn_fisher (str): ``'diagonal'`` (paper §5.4) or ``'full'``
            (``2C x 2C``) Fisher for BatchNormalization.
        factor_interval: Steps between refreshes of the statistics: an int,
            a callable ``f(iteration) -> int``, a
            :class:`~chainerkfac.schedules.Adaptive` policy, or a dict
            ``{'A': ..., 'G': ...}`` giving forward (A) and backward (G, and
            BatchNorm) statistics their own interval. ``None`` (the
            default) is ``Adaptive()``: each factor's interval starts at 1
            and doubles at every refresh (up to 50) while the averaged
            factor changes by less than 5 %, as it usually does with
            ``cov_ema_decay`` 0.95 (refreshes at steps 1, 2, 4, 8, 16, 32,
            then about every 50); on the convergence suite this stayed
            within seed noise of refreshing every step, in less time
            (docs/guide/tuning.md). ``1`` refreshes every step.
        inverse_interval: Steps between recomputations of the inverses (an
            int or a callable); an inverse is only recomputed when its
            factors or the damping changed since.
        inverse_delay (int): ``d > 0`` builds every inverse but a block's
            first in the background (Ba et al. 2017 §3.1,
            :mod:`chainerkfac.background`): an inverse refreshed from the
            factors of step ``t`` takes effect at step ``t + d``, the steps
            between using the one before; the numbers do not depend on the
            timing. A block refreshes no other inverse meanwhile. ``0``
            (the default) builds it at once.
        acc_iters (int): ``update(lossfun, *batch)`` splits the batch into
            this many micro-batches and accumulates gradients and statistics
            over them, emulating a batch ``acc_iters`` times larger in the
            memory of one.
        weight_decay (float): L2 coefficient as in the paper's §4.2: adds
            ``weight_decay * W`` to the gradient of every Linear and
            Convolution2D weight before preconditioning and ``weight_decay``
            to those layers' damping. Biases and BatchNorm are not decayed
            (§4.2 also pulls BatchNorm weights towards a non-zero mean).
        bn_damping_multiplier (float): BatchNorm blocks are damped with
            ``bn_damping_multiplier * damping``.
        nonfinite (str): On a NaN or Inf in a gradient or factor, ``'raise'``
            a :class:`~chainerkfac.curvature.NonFiniteError` naming it, or
            ``'skip'`` the step (reported as ``kfac/skipped_steps``); with
            ``update(lossfun, ...)`` a skipped step (or one that raises)
            also leaves BatchNorm's running statistics as they were.
        max_skipped_steps (int): After this many skipped steps in a row
            (non-finite gradients with ``nonfinite='skip'``, or overflows
            under Chainer's dynamic loss scaling), raise a
            :class:`~chainerkfac.curvature.NonFiniteError` naming the last
            non-finite gradient, instead of skipping for ever.
        precondition (bool): ``False`` turns K-FAC off entirely (no hooks, no
            statistics): the optimizer is then exactly MomentumSGD.
        spatial_subsample (int): Convolution A factors from every
            ``spatial_subsample``-th output row and column only, rescaled to
            all positions (KFC's spatial homogeneity, Grosse & Martens 2016
            §3); 1 takes every position. 2 divides the largest statistics'
            work by about 4.
        batch_subsample (int): Linear and Convolution2D factors from the
            first ``⌈n / batch_subsample⌉`` samples of each (local) batch
            only; 1 takes every sample. ``k`` divides the statistics' work
            by about ``k``; BatchNormalization statistics, which cost
            little, use the whole batch.
        conv_factors (str): The factors of layers with several positions
            per sample (Convolution2D, Linear with ``n_batch_axes > 1``):
            ``'expanded'`` (KFC, Grosse & Martens 2016: outer products at
            every position) or ``'reduced'`` (Ba et al. 2017, appendix A:
            the outer products of each sample's activations and
            derivatives summed over positions,
            ``A ⊗ G = |T|² E[Ā Āᵀ] ⊗ E[D̄ D̄ᵀ]``, the convention in
            :mod:`chainerkfac.curvature.kronecker`), which costs ``T``
            times fewer operations. ``'reduced'`` needs
            ``spatial_subsample=1``.
        doubly_factored_from (int or None): A Linear whose input is at
            least this wide (known at setup) and arrives as a feature map
            (``(n, C, H, W)``, which the link flattens) gets the
            doubly-factored block ``Ψ ⊗ K ⊗ G`` (Ba et al. 2017 §4;
            :class:`~chainerkfac.curvature.doubly_factored.DoublyFactoredBlock`):
            factors of ``T x T`` (positions) and ``C x C`` (channels)
            instead of one ``C T x C T``, its bias in a block of its own.
            ``None``: every Linear gets ``A ⊗ G``.
        kl_clip (float or None): The update-norm guard's bound κ (Ba et al.
            2017 §5, :mod:`chainerkfac.update_norm`): every block's step
            ``ρ_b F̂_b⁻¹∇_b`` is scaled by ``ν = min(1, sqrt(κ / q))``, with
            ``q = lr² Σ_b ρ_b² ⟨F̂_b⁻¹∇_b, ∇_b⟩`` over the K-FAC blocks, so
            that the step's approximate KL change stays bounded. Under the
            grafted step a safety net: the default 1e-2 leaves ordinary
            steps alone and stops those that would blow the model up; at
            a large-batch recipe's learning rates (1-2) it sets most steps
            (``docs/guide/tuning.md``). A
            hyperparameter: ``ExponentialShift('kl_clip', ...)`` gives it a
            schedule. ``None`` turns the guard off.
        kl_clip_relative (float or None): ``c``: the bound relative to the
            run's own steps, ``κ_t = max(κ, c · lr_t² · m_t)``, ``m_t`` the
            smallest ``q / lr²`` of the steps so far
            (:class:`~chainerkfac.update_norm.RelativeBound`): the guard binds
            where ``q`` grows over ``c`` times the smallest the run has
            had, not on the first steps of a network whose ``q`` starts
            large and falls. ``None`` keeps the fixed bound. Measured to
            help at learning rates up to 0.1 and to let runs at 0.8-1.6
            fall apart (``docs/guide/tuning.md``): an option, off by
            default.
        kl_clip_batch (int or None): The global batch at which the bound is
            ``kl_clip``; it grows like the batch below it and like its
            square above it: ``κ = kl_clip · r · max(r, 1)``,
            ``r = B / kl_clip_batch`` (``B`` the samples of the training
            forward passes since the previous step, micro-batches and a
            manual loop's several passes included, summed over processes).
            ``None`` keeps ``κ = kl_clip`` at every batch.
        divergence (str): On a divergence that stays finite (the training
            loss over 10 times its first value;
            :mod:`chainerkfac.divergence`), ``'warn'`` once or ``'raise'``
            a :class:`~chainerkfac.divergence.DivergenceError`. A guard
            that scales every update by less than 1e-3 for 100 steps while
            the loss does not fall is a stall: a
            :class:`~chainerkfac.divergence.StallWarning`, either way.
        independent_processes (bool): ``True`` lets every MPI process of a
            job train its own model with its own curvature (a
            hyperparameter sweep, one model per rank). By default K-FAC
            refuses to run in one of several MPI processes unless made
            distributed by :func:`chainerkfac.create_multi_node_optimizer`
            (:func:`~chainerkfac.optimizers.stages.refuse_under_mpi`),
            since under ``chainermn.create_multi_node_optimizer`` the
            replicas would drift apart without a word.

    A misspelt option raises ``TypeError`` naming the nearest one
    (``dampening`` → ``damping``), and the names other K-FAC libraries use
    (``learning_rate``, ``factor_decay``, ``inv_update_steps``, ...) name
    this one's.
    """

    def __init__(self, lr=_default_hyperparam.lr,
                 momentum=_default_hyperparam.momentum,
                 damping=_default_hyperparam.damping,
                 cov_ema_decay=_default_hyperparam.cov_ema_decay,
                 inverse='cholesky', bn_fisher='diagonal',
                 factor_interval=None, inverse_interval=1, acc_iters=1,
                 weight_decay=_default_hyperparam.weight_decay,
                 bn_damping_multiplier=(
                     _default_hyperparam.bn_damping_multiplier),
                 nonfinite='raise', precondition=True, spatial_subsample=1,
                 batch_subsample=1, kl_clip=_default_hyperparam.kl_clip,
                 kl_clip_batch=64, kl_clip_relative=None, divergence='warn',
                 max_skipped_steps=100,
                 step_rule='graft', conv_factors='expanded',
                 independent_processes=False, inverse_delay=0,
                 doubly_factored_from=None, **unknown):
        options.reject_unknown(unknown, type(self).__init__)
        super().__init__()
        hp = self.hyperparam
        hp.lr = lr
        hp.momentum = momentum
        hp.damping = damping
        hp.cov_ema_decay = cov_ema_decay
        hp.weight_decay = weight_decay
        hp.bn_damping_multiplier = bn_damping_multiplier
        hp.kl_clip = kl_clip
        options.check_hyperparameters(hp)
        self.inverse = options.choice(inverse, options.INVERSES, 'inverse')
        self.bn_fisher = options.choice(bn_fisher, options.BN_FISHERS,
                                        'bn_fisher')
        self.nonfinite = options.choice(nonfinite, options.NONFINITE,
                                        'nonfinite')
        self.divergence = options.choice(divergence, options.DIVERGENCE,
                                         'divergence')
        self.step_rule = step_rule_module.get(step_rule)
        self._monitor = divergence_module.DivergenceMonitor(self.divergence)
        self.factor_interval = options.factor_intervals(
            schedules.Adaptive() if factor_interval is None
            else factor_interval)
        self.inverse_interval = options.inverse_interval(inverse_interval)
        self.inverse_delay = options.count(inverse_delay, 'inverse_delay')
        self.acc_iters = options.positive_int(acc_iters, 'acc_iters')
        self.spatial_subsample = options.positive_int(spatial_subsample,
                                                      'spatial_subsample')
        self.batch_subsample = options.positive_int(batch_subsample,
                                                    'batch_subsample')
        self.conv_factors = options.conv_factors(conv_factors,
                                                 self.spatial_subsample)
        self.doubly_factored_from = None if doubly_factored_from is None \
            else options.positive_int(doubly_factored_from,
                                      'doubly_factored_from')
        self.kl_clip_batch = None if kl_clip_batch is None else \
            options.positive_int(kl_clip_batch, 'kl_clip_batch')
        self.kl_clip_relative = None if kl_clip_relative is None else \
            options.real_at_least(kl_clip_relative, 'kl_clip_relative', 1)
        self._relative_bound = update_norm.RelativeBound()
        self.max_skipped_steps = options.positive_int(max_skipped_steps,
                                                      'max_skipped_steps')
        self._skipped_in_a_row = 0
        self._last_nonfinite = None
        self.use_kfac = bool(precondition)
        self.independent_processes = bool(independent_processes)
        #: A :class:`~chainerkfac.timing.StageTimer` every step adds the
        #: time of its stages to, or ``None`` (no timing).
        self.stage_timer = None
        self.blocks = []
        self._hook = None
        self._stages = stages_module.LocalStages()
        #: The snapshot files loaded since the last update
        #: (:class:`snapshot.Resume`), or ``None``.
        self._resume = None

    lr = optimizer.HyperparameterProxy('lr')
    momentum = optimizer.HyperparameterProxy('momentum')
    damping = optimizer.HyperparameterProxy('damping')
    cov_ema_decay = optimizer.HyperparameterProxy('cov_ema_decay')
    weight_decay = optimizer.HyperparameterProxy('weight_decay')
    bn_damping_multiplier = optimizer.HyperparameterProxy(
        'bn_damping_multiplier')
    kl_clip = optimizer.HyperparameterProxy('kl_clip')

    def create_update_rule(self):
        return KFACUpdateRule(self.hyperparam)

    def _next_step(self):
        return self.t + 1

    def timing(self, stage):
        """A context that adds its wall time to ``stage`` of
        :attr:`stage_timer` (:mod:`chainerkfac.timing`)."""
        return timing_module.timed(self.stage_timer, stage)

    @property
    def loss_scale(self):
        """The loss scale of Chainer's loss scaling (:meth:`loss_scaling`),
        which the gradients carry, or ``None``."""
        return self._loss_scale

    def whole_model_hooks(self):
        """Names of the pre-update optimizer hooks that need every gradient
        at once (``GradientClipping``), not one parameter at a time."""
        # Chainer keeps hooks in a private registry and offers no way to
        # list them: read here, in the optimizer, and nowhere else.
        return [name for name, hook in self._hookable._pre_update_hooks
                .items() if not getattr(hook, 'call_for_each_param', False)]

    # -- set-up -------------------------------------------------------------

    def setup(self, link):
        """Sets up momentum SGD for every parameter and K-FAC where it can."""
        super().setup(link)
        self.blocks = []
        self._unsupported = []
        if not self.use_kfac:
            self._stages.setup(self)
            return self
        options = base.BlockOptions(
            factor_intervals=self.factor_interval,
            inverse_interval=self.inverse_interval,
            inverse=self.inverse, bn_fisher=self.bn_fisher,
            spatial_subsample=self.spatial_subsample,
            batch_subsample=self.batch_subsample,
            conv_factors=self.conv_factors,
            doubly_factored_from=self.doubly_factored_from)
        self.blocks, self._unsupported = registry.blocks_of(link, options)
        by_link = {block.link: block for block in self.blocks}
        # Bound methods, not closures: a set-up optimizer (and its model)
        # must pickle and deep-copy, the copy's hook reading the copy.
        self._hook = hooks.StatisticsHook(by_link, self._next_step,
                                          self.timing)
        for block in self.blocks:
            if self._hook.name in block.link.local_link_hooks:
                block.link.delete_hook(self._hook.name)
            block.link.add_hook(self._hook)
        self._stages.setup(self)
        if self._unsupported and self._stages.rank_and_size()[0] == 0:
            base.fallback_logger.warning(
                'KFAC: %d link(s) without curvature follow momentum SGD: %s',
                len(self._unsupported), '; '.join(
                    '{} ({})'.format(name, reason)
                    for name, reason in self._unsupported))
        logger.info('%s', self.describe())
        return self

    @property
    def resuming(self):
        """Whether a snapshot was loaded since the last update (the next
        one moves its curvature to this run's owners)."""
        return self._resume is not None

    @property
    def stages(self):
        """The :class:`~chainerkfac.optimizers.stages.Stages` the step runs
        through (read-only; :meth:`use_stages` replaces them)."""
        return self._stages

    def use_stages(self, stages):
        """Runs the step's stages through ``stages`` (see
        :func:`chainerkfac.create_multi_node_optimizer`)."""
        self._stages = stages
        if getattr(self, 'target', None) is not None:
            stages.setup(self)

    def describe(self):
        """A table of which links get K-FAC and which get momentum SGD, and,
        in a distributed run, which rank owns each K-FAC link."""
        self._check_set_up()
        covered = {id(p) for b in self.blocks for p in b.params()}
        params = list(self.target.namedparams(include_uninit=True))
        # A parameter added after setup has no update rule: nothing
        # updates it, as with MomentumSGD.
        frozen = [name for name, p in params if p.update_rule is None]
        sgd = [name for name, p in params
               if id(p) not in covered and p.update_rule is not None]
        where = self._stages.placement(self.blocks)
        rows = [(b.name, b.describe() if where is None
                 else '{}; {}'.format(b.describe(), where[i]))
                for i, b in enumerate(self.blocks)]
        rows += [(name, 'momentum SGD: {}'.format(reason))
                 for name, reason in self._unsupported]
        width = max([len(r[0]) for r in rows] + [4])
        lines = ['KFAC ({} step, {} inverse, {} BatchNorm Fisher): {} blocks'
                 .format(self.step_rule.name, self.inverse, self.bn_fisher,
                         len(self.blocks))]
        lines += ['  {:<{}}  {}'.format(n, width, d) for n, d in rows]
        if sgd:
            lines.append('  momentum SGD parameters: {}'.format(
                ', '.join(sgd)))
        if frozen:
            lines.append('  not updated (added after setup; call setup '
                         'again): {}'.format(', '.join(frozen)))
        return '\n'.join(lines)

    def option_values(self):
        """``{option: text}``: every constructor option and hyperparameter
        as text that two processes which set the same values print alike
        (a schedule by its ``repr``, a plain function by its name), for
        comparing processes (:mod:`chainerkfac.distributed.consistency`).
        """
        return options.option_values(self)

    # -- the step -----------------------------------------------------------

    def update(self, lossfun=None, *args, **kwds):
        """Computes gradients (if ``lossfun`` is given) and takes one step.

        With ``lossfun``, the batch in ``args``/``kwds`` is split into
        ``acc_iters`` micro-batches along axis 0; their gradients are
        averaged and their statistics pooled. Without it, the gradients (and
        any statistics collected since the last step) are used as they are.
        """
        if getattr(self, 'target', None) is None:
            raise RuntimeError('KFAC.update() before setup(): call '
                               'optimizer.setup(model) first')
        options.check_hyperparameters(self.hyperparam,
                                      'iteration {}'.format(self.t + 1))
        self._stages.prepare(self)
        if self.step_rule.chooses_update:
            self.step_rule.check(self, lossfun)
        # The forward pass moves BatchNorm's running averages: put them back
        # when the step is skipped or raises.
        running = [] if lossfun is None else \
            nonfinite.running_statistics(self.target)
        try:
            with self.timing('update'):
                taken, mean_loss, scale = self._step(lossfun, args, kwds)
        except BaseException:
            nonfinite.restore(running)
            raise
        chainer.report({'kfac/skipped_steps': int(not taken)})
        if not taken:
            nonfinite.restore(running)
        self._count_skipped(taken)
        if taken:
            self._monitor.observe(self.t, mean_loss, scale)

    def _step(self, lossfun, args, kwds):
        """Gradients (with ``lossfun``), the curvature and the update rule;
        returns ``(taken, mean loss or None, the guard's scale)``."""
        mean_loss = None
        if lossfun is not None:
            self.target.cleargrads()
            losses = []
            for chunk_args, chunk_kwds in accumulation.micro_batches(
                    args, kwds, self.acc_iters):
                with self.timing('forward'):
                    loss = lossfun(*chunk_args, **chunk_kwds)
                with self.timing('backward'):
                    loss.backward(loss_scale=self._loss_scale)
                losses.append(loss.array)
                del loss
            mean_loss = float(sum(losses)) / len(losses)
            if self.acc_iters > 1:
                for param in self.target.params():
                    if param.grad is not None:
                        param.grad /= self.acc_iters
        self.reallocate_cleared_grads()
        if self._resume is not None:
            # After the forward pass: lazily initialised layers have their
            # shapes, which the placement of the blocks needs.
            self._stages.redistribute(self, self._resume)
            self._resume = None
        stats = self._stages.reduce(self)
        self.check_nan_in_grads()
        self.call_hooks('pre')
        self.t += 1
        samples = self._hook.take_batch_size() if self._hook else None
        taken = self._stages.agree(self.is_safe_to_update()
                                   and self._check_finite_gradients())
        scale = None
        rule = self.step_rule if self.step_rule.chooses_update else None
        if rule:
            params = [p for p in self.target.params() if p.grad is not None]
        if taken:
            if rule:
                rule.keep_gradient(params)
            scale = self.update_curvature(stats, samples)
            taken = self._preconditioned_fit()
        if taken:
            if rule:
                rule.choose(self, params, lossfun, args, kwds, mean_loss)
            self._relative_bound.accept()
            for param in self.target.params():
                param.update()
            if rule:
                rule.after_update(self, lossfun)
        self.reallocate_cleared_grads()
        self.call_hooks('post')
        self.update_loss_scale()
        return taken, mean_loss, scale

    def _fold(self, block, stats):
        """``block.update_factors``; under ``nonfinite='skip'`` non-finite
        statistics are dropped (and counted as a refresh, as the other
        processes count it: they follow the owner's schedule)."""
        try:
            return block.update_factors(self.t, stats,
                                        self.hyperparam.cov_ema_decay)
        except base.NonFiniteError:
            if self.nonfinite == 'raise':
                raise
            logger.warning('iteration %d: dropped non-finite statistics of '
                           '%s', self.t, block.name)
            for f in stats:
                block.schedules[f].mark(self.t)
            return {}

    def update_curvature(self, stats, samples=None):
        """Folds statistics, refreshes due inverses, preconditions gradients.

        ``stats`` is ``{block: {factor: batch mean}}``; ``samples`` the
        size of this process's batch (``None``: unknown, the guard's bound
        is then ``kl_clip`` as given). Reports
        ``kfac/damping``, ``kfac/step_scale`` (the geometric mean of the
        step rule's ``ρ``), ``kfac/kl`` (the guard's ``q`` of the rule's
        step, before the guard), ``kfac/update_scale`` (the guard's
        ``ν``), ``kfac/factor_refreshes``
        (factors refreshed this step), ``kfac/inverse_refreshes`` and, on
        steps that refreshed a factor, ``kfac/change_rate`` (mean over those
        factors). Scales every block's preconditioned gradient by ``ρ ν``.
        Returns the guard's scale ``ν``.
        """
        step = self.t
        hp = self.hyperparam
        rates = {}
        owned = self._stages.owned(self.blocks)
        if stats:
            with self.timing('statistics_fold'):
                for block in owned:
                    if block in stats:
                        rates[block] = self._fold(block, stats[block])

        # An inverse on its way since step t - d goes in place first, so that
        # step t can start the next one.
        ready = [block for block in owned if block.pending is not None
                 and block.pending[0] <= step]
        refreshed = []
        if ready:
            # Waits for the worker only if it is late.
            with self.timing('inversion'):
                refreshed = [block for block in ready
                             if block.take_pending(step)]
        due = [block for block in owned
               if block.inverse_due(step, block.effective_damping(hp))]
        if due:
            with self.timing('inversion'):
                # Under an inverse_delay, the inverses that replace one
                # go to the background worker (one thread), the first
                # ones are built now.
                now = [block for block in due if not self.inverse_delay
                       or block.form is None]
                for block in [b for b in due if b not in now]:
                    block.update_inverse(step, block.effective_damping(hp),
                                         self.inverse_delay)
                refreshed += [block for block, done in zip(
                    now, cpu_parallel.map_blocks(
                        lambda block: block.update_inverse(
                            step, block.effective_damping(hp)),
                        now, cpu_parallel.block_work('inverse_cost')))
                    if done]
        self._stages.share_inverses(self, refreshed)
        # The scale the gradients carry (that of their backward, which a
        # manual loop may pass without loss_scaling()); the decay term must
        # carry it too, and the guard divides it out. (A lazily initialised
        # link not yet called has no gradient to say it.)
        shaped = next((b for b in self.blocks if b.shaped()), None)
        scale = self._loss_scale if shaped is None \
            else shaped.gradient_loss_scale()
        with self.timing('precondition'):
            terms = self._stages.precondition(
                self, hp.weight_decay * (scale or 1))
        terms, batch = self._stages.gather(self, terms, samples or 0)
        rho = self.step_rule.scales(terms)
        kl = update_norm.kl_estimate(float(rho * rho @ terms[:, 0]), hp.lr,
                                     scale)
        kappa = None if self.step_rule.chooses_update else \
            self._relative_bound.bound(
                update_norm.bound(hp.kl_clip, batch or None,
                                  self.kl_clip_batch),
                self.kl_clip_relative, kl, hp.lr)
        nu = update_norm.scale(kl, kappa)
        for block, factor in zip(self.blocks, rho * nu):
            if factor != 1:
                for param in block.params():
                    if param.grad is not None:
                        param.grad *= float(factor)
        measured = [r for block_rates in rates.values()
                    for r in block_rates.values() if r is not None]
        report = {'kfac/damping': hp.damping,
                  'kfac/kl': kl, 'kfac/update_scale': nu,
                  'kfac/step_scale': step_rule_module.typical(rho),
                  'kfac/factor_refreshes': sum(map(len, rates.values())),
                  'kfac/inverse_refreshes': len(refreshed)}
        if measured:
            report['kfac/change_rate'] = sum(measured) / len(measured)
        chainer.report(report)
        return nu

    # -- state --------------------------------------------------------------

    def serialize(self, serializer):
        """Saves or loads momentum, step counters and all K-FAC state:
        every block's factors, inverses (one on its way under
        ``inverse_delay`` included) and refresh schedules, the relative
        bound's ``m_t``, the divergence monitor's first loss and counts,
        the steps skipped in a row and a dynamic loss scale, so that a
        resumed run takes the steps an uninterrupted one takes.

        The K-FAC state starts with a header: the process's rank and the
        number of processes, the inverse form, the BatchNorm Fisher, every
        K-FAC layer with its factor shapes, and the layers whose curvature
        this process holds. Loading checks it against this run and raises
        ``ValueError`` naming what differs. Each process keeps the
        curvature of the layers it owns: on as many processes, each loads
        its own file; on another number, each loads the files
        :func:`chainerkfac.snapshot_files` gives it, and the first update
        moves every layer's curvature to its new owner
        (:mod:`chainerkfac.optimizers.snapshot`). Loaded factors and
        inverses must be finite. A snapshot without K-FAC state (written
        by MomentumSGD) loads the momentum and step count; the curvature
        then starts afresh.
        """
        if getattr(self, 'target', None) is None:
            raise RuntimeError('KFAC saved or loaded before setup(): call '
                               'optimizer.setup(model) first (setup creates '
                               'the state a snapshot holds)')
        state = serializer['kfac']
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        rank, size = self._stages.rank_and_size()
        mine = snapshot.header(rank, size, self.inverse, self.bn_fisher,
                               self.blocks)
        found = loading and snapshot.check_header(state, mine, self.blocks)
        if not loading:
            for key, value in mine.items():
                state['header'](key, value)
            state['header']('held', snapshot.held(self.blocks))
        super().serialize(serializer)
        if loading:
            self._check_finite_momentum()
        self._relative_bound.serialize(state['guard'],
                                       self.kl_clip_relative)
        if loading and not found:
            logger.warning('the snapshot holds no K-FAC state (another '
                           "optimizer's?): momentum and step count loaded, "
                           'the curvature starts afresh')
            return
        self._monitor.serialize(state['divergence'])
        if self.step_rule.chooses_update:
            self.step_rule.serialize(state['adaptive'], self.damping)
        self.serialize_checks(state['nonfinite'])
        names = {block.name for block in self.blocks}
        if isinstance(found, tuple):
            saved_rank, saved_size, held = found
            names = names if held is None else held
            if self._resume is None:
                self._resume = snapshot.Resume(saved_size)
            self._resume.add(saved_rank, saved_size, names)
        for block in self.blocks:
            if block.name in names:
                block.serialize(state[block.name])
            else:
                block.serialize_schedules(state[block.name])
