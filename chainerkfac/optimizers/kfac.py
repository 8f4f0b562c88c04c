"""K-FAC: the optimizer that replaces ``chainer.optimizers.MomentumSGD``.

One step (Osawa et al. CVPR 2019, Algorithm 1, single process)::

    forward/backward        link hooks collect A and G on refresh steps only
    optimizer hooks 'pre'   e.g. WeightDecay, GradientClipping
    curvature               C <- d C + (1 - d) C_new; damped inverses when due
    precondition            V <- F̂⁻¹ ∇ for every supported link
    step length             V_b <- ν ρ V_b: the natural direction with
                            grafting's KL change, at most a fixed KL change
                            that grows with the batch (step_rule.py)
    update rule             v <- momentum v - lr V;  w <- w + v
    optimizer hooks 'post'
"""
import logging

import chainer
from chainer import optimizer
from chainer.optimizers import momentum_sgd

from chainerkfac import divergence as divergence_module
from chainerkfac import hooks
from chainerkfac import step_rule as step_rule_module
from chainerkfac import timing as timing_module
from chainerkfac.curvature import cost
from chainerkfac.curvature import registry
from chainerkfac.optimizers import accumulation
from chainerkfac.optimizers import nonfinite
from chainerkfac.optimizers import options
from chainerkfac.optimizers import quadratic_model  # NOQA  (its rule)
from chainerkfac.optimizers import refresh
from chainerkfac.optimizers import snapshot
from chainerkfac.optimizers import stages as stages_module

logger = logging.getLogger(__name__)

_default_hyperparam = optimizer.Hyperparameter()
_default_hyperparam.lr = 0.01
_default_hyperparam.momentum = 0.9
_default_hyperparam.damping = 1e-3
_default_hyperparam.cov_ema_decay = 0.95
_default_hyperparam.weight_decay = 0.0
_default_hyperparam.bn_damping_multiplier = 1.0
_default_hyperparam.kl_clip = 5e-4


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
    gradients; all other parameters get momentum SGD. One step::

        v <- momentum v - lr ν ρ_b F̂_b⁻¹∇_b;     w <- w + v

    with ``ρ_b`` the step rule's scale of block ``b`` and ``ν`` the
    bound's on the step's KL change (both :mod:`chainerkfac.step_rule`).

    Every option, its default and its formula: "Hyperparameters and
    options" (``docs/options.md``). A misspelt option, or another K-FAC
    library's name for one, raises ``TypeError`` naming this one's.
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
                 divergence='warn', max_skipped_steps=100,
                 step_rule=step_rule_module.DEFAULT,
                 conv_factors='expanded',
                 independent_processes=False, inverse_delay=0,
                 doubly_factored_from=None, **unknown):
        options.reject_unknown(unknown, type(self).__init__)
        super().__init__()
        options.set_hyperparameters(
            self.hyperparam, lr=lr, momentum=momentum, damping=damping,
            cov_ema_decay=cov_ema_decay, weight_decay=weight_decay,
            bn_damping_multiplier=bn_damping_multiplier, kl_clip=kl_clip)
        options.configure(
            self, inverse=inverse, bn_fisher=bn_fisher, nonfinite=nonfinite,
            divergence=divergence, step_rule=step_rule,
            factor_interval=factor_interval,
            inverse_interval=inverse_interval, inverse_delay=inverse_delay,
            acc_iters=acc_iters, spatial_subsample=spatial_subsample,
            batch_subsample=batch_subsample, conv_factors=conv_factors,
            doubly_factored_from=doubly_factored_from,
            max_skipped_steps=max_skipped_steps, precondition=precondition,
            independent_processes=independent_processes)
        self._monitor = divergence_module.DivergenceMonitor(
            self.divergence, None if not self.step_rule.chooses_update else
            'the quadratic model chooses the step, without a learning rate '
            'or the bound: keep more damping (step_rule=QuadraticModel('
            'min_damping=1e-3)) or use the default step rule')
        self._bound = step_rule_module.Bound(lr)
        self._skipped_in_a_row = 0
        self._last_nonfinite = None
        #: A :class:`~chainerkfac.timing.StageTimer` every step adds the
        #: time of its stages to, or ``None`` (no timing).
        self.stage_timer = None
        self.blocks = []
        self._hook = None
        self._stages = stages_module.Stages()
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

    def _rows_wanted(self):
        """Whether Linear layers may precondition from their batch's rows
        (:mod:`chainerkfac.curvature.low_rank`): where the rows are the
        whole gradient (no hooks or decay add to it), in one process."""
        return (not self.hyperparam.weight_decay
                and not self._hookable._pre_update_hooks
                and self._stages.rank_and_size()[1] == 1)

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
        # list them: read here, in the optimizer, and in options.
        return options.whole_model_hooks(self._hookable)

    # -- set-up -------------------------------------------------------------

    def setup(self, link):
        """Sets up momentum SGD for every parameter and K-FAC where it can."""
        super().setup(link)
        self.blocks = []
        self._unsupported = []
        if not self.use_kfac:
            self._stages.setup(self)
            return self
        self.blocks, self._unsupported = registry.blocks_of(
            link, options.block_options(self))
        by_link = {block.link: block for block in self.blocks}
        # Bound methods, not closures: a set-up optimizer (and its model)
        # must pickle and deep-copy, the copy's hook reading the copy.
        self._hook = hooks.StatisticsHook(by_link, self._next_step,
                                          self.timing, self._rows_wanted)
        for block in self.blocks:
            if self._hook.name in block.link.local_link_hooks:
                block.link.delete_hook(self._hook.name)
            block.link.add_hook(self._hook)
        self._stages.setup(self)
        if self._stages.rank_and_size()[0] == 0:
            registry.warn_unsupported(self._unsupported)
        logger.info('%s', self.describe())
        return self

    @property
    def resuming(self):
        """Whether a snapshot was loaded since the last update."""
        return self._resume is not None

    @property
    def stages(self):
        """The :class:`~chainerkfac.optimizers.stages.Stages` of the step
        (:meth:`use_stages` replaces them)."""
        return self._stages

    def use_stages(self, stages):
        """Runs the step's stages through ``stages`` (see
        :func:`chainerkfac.create_multi_node_optimizer`)."""
        self._stages = stages
        if getattr(self, 'target', None) is not None:
            stages.setup(self)

    def describe(self):
        """A table of which links get K-FAC and which momentum SGD, which
        rank owns each K-FAC link in a distributed run, and, after a
        training pass, the estimated work of each layer and of the model
        (:func:`chainerkfac.curvature.registry.coverage`)."""
        self._check_set_up()
        header = ('KFAC ({} step, {} inverse, {} BatchNorm Fisher): {} '
                  'blocks'.format(self.step_rule.name, self.inverse,
                                  self.bn_fisher, len(self.blocks)))
        return '\n'.join([header] + registry.coverage(
            self.target, self.blocks, self._unsupported,
            self._stages.placement(self.blocks), self._block_work()))

    def _block_work(self):
        return [block.step_work(self.acc_iters, self._rows_wanted())
                for block in self.blocks]

    def work_estimate(self):
        """The model's :class:`~chainerkfac.curvature.cost.StepWork` at the
        last training pass's batch (``None`` before one)."""
        return cost.total(self._block_work())

    def hook_descriptions(self):
        """``'name (timing): attribute=value, ...'`` of every optimizer
        hook, in the order they run, alike where two processes added the
        same hooks with the same settings."""
        return options.hook_descriptions(self._hookable)

    def option_values(self):
        """``{option: text}`` of every option and hyperparameter, and the
        optimizer hooks, alike where two processes set the same values
        (:mod:`chainerkfac.distributed.consistency`)."""
        return dict(options.option_values(self), **{
            'optimizer hooks': '; '.join(self.hook_descriptions()) or 'none'})

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
                taken, mean_loss, scale = self._step(lossfun, args, kwds,
                                                     running)
        except BaseException as error:
            nonfinite.restore(running)
            # The statistics of a step that did not happen must not enter
            # the next refresh.
            self.discard_statistics()
            self._stages.abandon(error)
            raise
        for block in self.blocks:  # the rows the step did not use
            block.clear_rows()
        chainer.report({'kfac/skipped_steps': int(not taken)})
        if not taken:
            nonfinite.restore(running)
        self._count_skipped(taken)
        if taken:
            self._monitor.observe(self.t, mean_loss, scale)

    def discard_statistics(self):
        """Drops the statistics and sample counts collected since the last
        step (of forward passes whose step did not happen)."""
        for block in self.blocks:
            block.discard_statistics()
            block.clear_rows()
        if self._hook is not None:
            self._hook.discard()

    def _step(self, lossfun, args, kwds, running):
        """Gradients (with ``lossfun``), the curvature and the update rule;
        returns ``(taken, mean loss or None, the bound's scale)``."""
        mean_loss = None if lossfun is None else \
            accumulation.gradients(self, lossfun, args, kwds)
        if self._stages.broadcast_new_parameters(self):
            # Lazily initialised links drew their first weights on each
            # process: the step is one process's from rank 0's weights, so
            # the gradients and statistics are computed again from them.
            self.discard_statistics()
            nonfinite.restore(running)
            mean_loss = accumulation.again(self, lossfun, args, kwds)
            if mean_loss is None:
                return False, None, None
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
        taken = self._stages.agree(
            self.is_safe_to_update() and self._check_finite_gradients())
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
            for param in self.target.params():
                param.update()
            if rule:
                rule.after_update(self, lossfun)
        self.reallocate_cleared_grads()
        self.call_hooks('post')
        self.update_loss_scale()
        return taken, mean_loss, scale

    def update_curvature(self, stats, samples=None):
        """Folds statistics, refreshes due inverses, preconditions gradients.

        ``stats`` is ``{block: {factor: batch mean}}``; ``samples`` the
        size of this process's batch (``None``: unknown, the bound is then
        ``kl_clip`` at the schedule's peak). Scales every block's
        preconditioned gradient by ``ρ ν``; returns the bound's ``ν``.
        Reports the ``kfac/`` values of the reporting guide.
        """
        hp = self.hyperparam
        rates = {}
        owned = self._stages.owned(self.blocks)
        if stats:
            with self.timing('statistics_fold'):
                rates = refresh.fold(self, owned, stats)
        refreshed = refresh.inverses(self, owned)
        self._stages.share_inverses(self, refreshed)
        # The scale the gradients carry (that of their backward, which a
        # manual loop may pass without loss_scaling()); the decay term must
        # carry it too, and the bound divides it out. (A lazily initialised
        # link not yet called has no gradient to say it.)
        scale = registry.gradient_loss_scale(self.blocks,
                                             self._loss_scale)
        with self.timing('precondition'):
            terms = self._stages.precondition(
                self, hp.weight_decay * (scale or 1))
        terms, batch = self._stages.gather(self, terms, samples or 0)
        batch = batch or None  # 0: not known
        sums = step_rule_module.Sums.of(terms).without(
            i for i, block in enumerate(self.blocks) if block.frozen())
        kappa = None if self.step_rule.chooses_update else \
            self._bound(hp.kl_clip, hp.lr, batch)
        step = step_rule_module.length(self.step_rule, sums, hp.lr, kappa,
                                       scale, batch)
        step_rule_module.rescale(self.blocks, step.rho * step.nu)
        chainer.report(dict(refresh.report(rates, refreshed), **step.report(),
                            **{'kfac/damping': hp.damping}))
        return step.nu

    def serialize(self, serializer):
        """Saves or loads momentum, step counters and all K-FAC state, so
        that a resumed run takes the steps an uninterrupted one takes
        (:func:`chainerkfac.optimizers.snapshot.serialize`; what a snapshot
        holds: the checkpointing guide)."""
        loading = isinstance(serializer, chainer.serializer.Deserializer)

        def momentum():
            super(KFAC, self).serialize(serializer)
            if loading:
                self._check_finite_momentum()
        self._resume = snapshot.serialize(
            serializer, self, momentum, self._resume, {
                'bound': self._bound.serialize,
                'divergence': self._monitor.serialize,
                'nonfinite': self.serialize_checks})
