"""The adaptive step: length, momentum and damping from the loss's quadratic
model (Martens & Grosse 2015 §6.4-6.6 and §7; kfac-jax's adaptive mode),
``step_rule='adaptive'`` of :class:`~chainerkfac.optimizers.KFAC`.

With ``Δ = −F̂⁻¹∇h`` the preconditioned direction (a parameter outside the
K-FAC blocks takes ``−∇h``), ``v`` the previous update and ``G`` the
Gauss–Newton matrix of the loss ``h`` on the current batch, the update is::

    δ = α Δ + μ v,     (α, μ) = argmin M(α Δ + μ v)
    M(δ) = ∇hᵀδ + ½ δᵀ (G + λ I) δ

that is (§7), with ``C = G + λ I``::

    [ΔᵀCΔ  ΔᵀCv] [α]     [∇hᵀΔ]
    [vᵀCΔ  vᵀCv] [μ] = − [∇hᵀv]

and ``μ = 0`` while ``v = 0`` (the first step). The learning rate and the
momentum options are not used: the model chooses both, at every step.
``λ`` is also the damping of K-FAC's inverses (the ``damping`` option gives
its first value). Every ``T`` steps the reduction ratio on the same batch,
``ρ = (h(θ + δ) − h(θ)) / M(δ)``, moves it (Levenberg–Marquardt, §6.5)::

    λ <- ω λ   where ρ > 3/4;     λ <- λ / ω   where ρ < 1/4;     ω = (19/20)^T

``G`` is that of softmax cross-entropy over a classifier's logits ``z``
(the mean over the batch's ``n`` samples, ``p_i = softmax(z_i)``)::

    uᵀ G w = (1/n) Σ_i (J_i u)ᵀ (diag p_i − p_i p_iᵀ) (J_i w)

``J_i u``, the change of sample ``i``'s logits along ``u``, is a finite
difference of the predictor, one forward pass per vector:
``(z(θ + ε u) − z(θ)) / ε`` with ``ε ‖u‖ = sqrt(machine ε) (1 + ‖θ‖)``.
So the rule needs the model's predictor: ``update(lossfun, x, t)`` with a
``chainer.links.Classifier`` whose ``lossfun`` is
``softmax_cross_entropy`` (the Trainer's default), in one process, without
``acc_iters``, and a predictor whose forward pass is not random (no
dropout). It costs two more forward passes on every step and a third
every ``T`` steps, and a copy of the gradients.
"""
import math

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
from chainer import backend

from chainerkfac import step_rule
from chainerkfac.optimizers import nonfinite


def solve(curvature, euclidean, linear, damping):
    """``(coefficients, M)``: the minimiser ``x`` of
    ``M(x) = bᵀx + ½ xᵀ(G + λE)x`` (``G`` the Gram matrix ``curvature``
    of the vectors under the Gauss–Newton matrix, ``E`` their Euclidean
    ``euclidean``, ``b`` the gradient's inner products ``linear``,
    ``λ = damping``) and the model's change ``M(x) = ½ bᵀx``. A vector
    that is zero (no previous update) keeps its coefficient at 0."""
    curvature = numpy.asarray(curvature, dtype=numpy.float64)
    linear = numpy.asarray(linear, dtype=numpy.float64)
    system = curvature + damping * numpy.asarray(euclidean,
                                                 dtype=numpy.float64)
    used = numpy.diag(system) > 0
    x = numpy.zeros(len(linear))
    if used.any():
        x[used] = -numpy.linalg.lstsq(system[numpy.ix_(used, used)],
                                      linear[used], rcond=None)[0]
    return x, 0.5 * float(linear @ x)


def gauss_newton_gram(logits, changes):
    """``[uᵀ G w]`` over the pairs of ``changes`` (each the ``(n, K)``
    change ``J u`` of the logits ``logits`` along one vector) for the mean
    softmax cross-entropy."""
    xp = backend.get_array_module(logits)
    p = F.softmax(logits.astype(numpy.float64)).array
    n = len(logits)
    gram = numpy.zeros((len(changes), len(changes)))
    for a, ja in enumerate(changes):
        # (diag p − p pᵀ) J u, sample by sample.
        hja = p * ja - p * (p * ja).sum(axis=1, keepdims=True)
        for b in range(a, len(changes)):
            gram[a, b] = gram[b, a] = float(
                xp.vdot(hja.ravel(), changes[b].ravel())) / n
    return gram


class LevenbergMarquardt:
    """``λ`` and its rule: every ``interval`` steps, ``λ <- ω λ`` where the
    reduction ratio ``ρ > 3/4`` and ``λ <- λ / ω`` where ``ρ < 1/4``,
    ``ω = decay ** interval`` (Martens & Grosse 2015 §6.5)."""

    def __init__(self, damping, interval=5, decay=19 / 20,
                 bounds=(1e-8, 1e8)):
        self.damping = damping
        self.interval = interval
        self.omega = decay ** interval
        self.bounds = bounds

    def due(self, step):
        """Whether step ``step`` measures ``ρ``."""
        return step % self.interval == 0

    def adapt(self, rho):
        """Moves ``λ`` by the reduction ratio ``rho`` (a NaN or infinite
        ``ρ`` counts as a bad step)."""
        if rho > 0.75:
            self.damping *= self.omega
        elif not rho >= 0.25:
            self.damping /= self.omega
        self.damping = min(max(self.damping, self.bounds[0]),
                           self.bounds[1])

    def serialize(self, serializer):
        self.damping = float(serializer('damping', self.damping))


@step_rule.register
class QuadraticModel(step_rule.StepRule):
    """``step_rule='adaptive'``: the natural direction ``Δ``, and ``α``,
    ``μ`` and ``λ`` from the quadratic model (this module's formulas)."""

    name = 'adaptive'
    chooses_update = True

    def __init__(self, interval=5, min_damping=1e-8):
        """``interval`` is ``T``; ``λ`` never falls below ``min_damping``
        (kfac-jax's option of that name)."""
        self.interval = interval
        self.min_damping = min_damping
        #: The :class:`LevenbergMarquardt` rule, from the optimizer's
        #: ``damping`` at its first step.
        self.levenberg_marquardt = None
        self._gradient = None
        self._step = None

    def _rule(self, damping):
        return LevenbergMarquardt(damping, self.interval,
                                  bounds=(self.min_damping, 1e8))

    def scales(self, sums, batch=None):
        return numpy.ones(len(sums.vg))

    # -- called by the optimizer around its step ----------------------------

    def check(self, optimizer, lossfun):
        """Refuses, by name, what the model cannot serve."""
        if optimizer.stages.rank_and_size()[1] > 1:
            raise ValueError("KFAC step_rule='adaptive' runs in one process "
                             'only')
        if optimizer.acc_iters != 1:
            raise ValueError("KFAC step_rule='adaptive' needs acc_iters=1, "
                             'got {}'.format(optimizer.acc_iters))
        if not (isinstance(lossfun, L.Classifier)
                and lossfun.lossfun is F.softmax_cross_entropy):
            raise ValueError(
                "KFAC step_rule='adaptive' needs update(lossfun, x, t) with "
                'lossfun a chainer.links.Classifier of softmax_cross_entropy '
                '(its predictor gives the logits of the Gauss-Newton '
                'products), got {!r}'.format(lossfun))
        if not optimizer.lr > 0:
            raise ValueError("KFAC step_rule='adaptive' needs lr > 0 (the "
                             'update is written through the momentum rule), '
                             'got {}'.format(optimizer.lr))
        if self.levenberg_marquardt is None:
            self.levenberg_marquardt = self._rule(optimizer.damping)
        optimizer.damping = self.levenberg_marquardt.damping

    def keep_gradient(self, params):
        """Copies ``∇h`` (after the optimizer's hooks) before it is
        preconditioned."""
        self._gradient = [p.grad.copy() for p in params]

    def choose(self, optimizer, params, lossfun, args, kwds, loss):
        """Solves for ``α`` and ``μ`` and writes the update into the
        gradients, for the momentum rule ``v <- m v − η g``: ``g = (α V −
        (μ − m) v) / η`` gives ``v <- μ v − α V``, ``V = F̂⁻¹∇h`` being in
        the gradients now. Reports ``kfac/alpha`` and ``kfac/mu``."""
        gradient, self._gradient = self._gradient, None
        direction = [-p.grad for p in params]
        previous = [_velocity(p) for p in params]
        vectors = [direction, previous]
        inputs, kw, labels = _split(lossfun, args, kwds)
        base = lossfun.y.array
        with _perturbations(optimizer.target, params) as perturb:
            changes = [perturb(lossfun.predictor, inputs, kw, u, base)
                       for u in vectors]
        curvature = gauss_newton_gram(base, changes)
        euclidean = numpy.array([[_dot(a, b) for b in vectors]
                                 for a in vectors])
        linear = numpy.array([_dot(gradient, u) for u in vectors])
        lm = self.levenberg_marquardt
        (alpha, mu), change = solve(curvature, euclidean, linear,
                                    lm.damping)
        lr, m = optimizer.lr, optimizer.momentum
        for p, V, v in zip(params, (-d for d in direction), previous):
            p.grad[...] = (alpha * V - (mu - m) * v) / lr
        self._step = (loss, change, inputs, kw, labels)
        chainer.report({'kfac/alpha': alpha, 'kfac/mu': mu})

    def after_update(self, optimizer, lossfun):
        """On the steps that measure it, ``ρ`` from the loss after the
        update on the same batch; moves ``λ``, which :meth:`check` makes
        the next step's damping, and reports ``kfac/reduction_ratio``."""
        loss, change, inputs, kw, labels = self._step
        self._step = None
        lm = self.levenberg_marquardt
        if not lm.due(optimizer.t):
            return
        running = nonfinite.running_statistics(optimizer.target)
        with chainer.no_backprop_mode():
            after = float(lossfun.lossfun(
                lossfun.predictor(*inputs, **kw), labels).array)
        nonfinite.restore(running)
        rho = (after - loss) / change if change < 0 else math.nan
        lm.adapt(rho)
        chainer.report({'kfac/reduction_ratio': rho})

    def serialize(self, serializer, damping):
        """Saves or loads ``λ`` (``damping`` starts it where the snapshot
        holds none)."""
        if self.levenberg_marquardt is None:
            self.levenberg_marquardt = self._rule(damping)
        try:
            self.levenberg_marquardt.serialize(serializer)
        except KeyError:
            pass


def _velocity(param):
    """The momentum buffer ``v`` (the previous update), zeros before the
    first."""
    v = param.update_rule.state.get('v') if param.update_rule.state \
        else None
    return backend.get_array_module(param.grad).zeros_like(param.grad) \
        if v is None else v


def _dot(a, b):
    return sum(float(backend.get_array_module(x).vdot(x.ravel(), y.ravel()))
               for x, y in zip(a, b))


def _split(classifier, args, kwds):
    """The predictor's inputs and the labels, as ``Classifier.forward``
    takes them apart."""
    key = classifier.label_key
    if isinstance(key, int):
        labels = args[key]
        inputs = args[:key] + (args[key + 1:] if key != -1 else ())
        return inputs, kwds, labels
    kw = dict(kwds)
    return args, kw, kw.pop(key)


class _perturbations:
    """A context giving ``perturb(predictor, inputs, kw, u, base)``, the
    change ``J u`` of the logits along ``u`` by a forward difference;
    afterwards the parameters and BatchNorm's running statistics are as
    they were."""

    def __init__(self, target, params):
        self.target, self.params = target, params

    def __enter__(self):
        self.saved = [p.array.copy() for p in self.params]
        self.running = nonfinite.running_statistics(self.target)
        norm = math.sqrt(_dot(self.saved, self.saved))
        eps = float(numpy.finfo(self.saved[0].dtype).eps)
        self.scale = math.sqrt(eps) * (1 + norm)
        return self.perturb

    def perturb(self, predictor, inputs, kw, u, base):
        length = math.sqrt(_dot(u, u))
        if length == 0:
            return backend.get_array_module(base).zeros_like(base)
        epsilon = self.scale / length
        for p, w, d in zip(self.params, self.saved, u):
            p.array[...] = w + epsilon * d
        with chainer.no_backprop_mode():
            moved = predictor(*inputs, **kw).array
        for p, w in zip(self.params, self.saved):
            p.array[...] = w
        return (moved.astype(numpy.float64) - base) / epsilon

    def __exit__(self, *exc):
        for p, w in zip(self.params, self.saved):
            p.array[...] = w
        nonfinite.restore(self.running)
