"""Levenberg-Marquardt damping on the convergence suite: does it pay?

    PYTHONPATH=. .venv/bin/python benchmarks/lm_damping.py

Issue #23 asks for Levenberg-Marquardt damping adaptation (Martens & Grosse
2015 §6.5, kfac-jax's ``use_adaptive_damping``) as an option *if it pays*.
This measures it first, from outside the library, on the suite of
``convergence_suite.py`` (digits, batch 64, 200 iterations, four models,
lr 0.01 / 0.03 / 0.1, momentum 0.9, factors every step; same seeds, so the
rows compare with the variant ``every_step`` of
``results/convergence_suite.json``).

Every ``interval`` steps the damping ε follows the reduction ratio of the
step ``δ`` just taken, on the same batch::

    ρ = (L(θ + δ) - L(θ)) / M(δ),   M(δ) = ∇ᵀδ + ½ δᵀ G δ
    ρ > 3/4: ε <- ω ε      ρ < 1/4 (or undefined): ε <- ε / ω
    ω = (19/20)^interval

with ``G`` the Gauss-Newton matrix of softmax cross-entropy. ``δᵀGδ``
comes from the logits ``z`` of the two forward passes (the secant
``u = z(θ + δ) - z(θ)`` for ``J δ``, exact to second order in ``δ``):
``mean_i Σ_k p_ik u_ik² - (Σ_k p_ik u_ik)²``, ``p = softmax(z(θ))``. ``∇``
is the raw gradient, copied by a ``'pre'`` optimizer hook before K-FAC
preconditions it. ρ is undefined when ``M(δ) >= 0`` (a step that the model
does not predict to descend, which momentum can take). The extra forward
pass costs about a third of a step every ``interval`` steps. ε stays in
``DAMPING_RANGE``.

Three variants, all at K-FAC's default damping to start from:

* ``lm_guard``: with the update-norm guard at its default. ρ is that of the
  step the guard scaled.
* ``lm_no_guard``: without the guard (``kl_clip=None``): the damping alone
  keeps the steps in check.
* ``fixed_no_guard``: the baseline of ``lm_no_guard``: no guard, fixed
  damping.

What this leaves out of Martens & Grosse: they also choose each step's
length and momentum from the quadratic model (their §7) and start from a
large damping; here K-FAC's step (``lr F̂⁻¹∇`` with momentum) is kept and
only ε adapts, which is the option the issue names. Writes
``results/lm_damping.json``.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.functions as F
import numpy

import convergence_suite
import harness

DAMPING_RANGE = (1e-5, 100.0)


class RawGradients:
    """A ``'pre'`` optimizer hook that keeps a copy of the gradients while
    ``active``."""

    name = 'raw_gradients'
    call_for_each_param = False
    timing = 'pre'

    def __init__(self):
        self.active = False
        self.grads = []

    def __call__(self, optimizer):
        if self.active:
            self.grads = [None if p.grad is None else p.grad.copy()
                          for p in optimizer.target.params()]


class LevenbergMarquardt:
    """``KFAC`` whose damping follows the reduction ratio (module
    docstring); for a ``chainer.links.Classifier``, with
    ``update(lossfun, *batch)``."""

    def __init__(self, kfac, interval=5, decay=0.95):
        self.kfac = kfac
        self.interval = interval
        self.omega = decay ** interval
        self.t = 0
        self.ratios = []

    def setup(self, model):
        self.kfac.setup(model)
        self.model = model
        self.raw = RawGradients()
        self.kfac.add_hook(self.raw)

    def update(self, lossfun, *args):
        self.t += 1
        self.raw.active = self.t % self.interval == 0
        if not self.raw.active:
            self.kfac.update(lossfun, *args)
            return
        params = list(self.model.params())
        before = [p.array.copy() for p in params]
        self.kfac.update(lossfun, *args)
        loss, z = self.model.loss, self.model.y.array
        step_dot_grad = sum(float((g * (p.array - b)).sum()) for g, p, b
                            in zip(self.raw.grads, params, before)
                            if g is not None)
        norms = [bn for bn in self.model.links()
                 if isinstance(bn, chainer.links.BatchNormalization)]
        running = [(bn.avg_mean.copy(), bn.avg_var.copy()) for bn in norms]
        with chainer.no_backprop_mode():
            new_loss = float(lossfun(*args).array)
            u = self.model.y.array - z
        # The evaluation is not a training step: BatchNorm's averages stay.
        for bn, (mean, var) in zip(norms, running):
            bn.avg_mean[...], bn.avg_var[...] = mean, var
        self.model.loss = loss
        p = F.softmax(z).array
        gauss_newton = float(((p * u * u).sum(1) - (p * u).sum(1) ** 2)
                             .mean())
        model_change = step_dot_grad + 0.5 * gauss_newton
        rho = ((new_loss - float(loss.array)) / model_change
               if model_change < 0 else float('nan'))
        damping = self.kfac.damping
        if rho > 0.75:
            damping *= self.omega
        elif not rho >= 0.25:
            damping /= self.omega
        self.kfac.damping = min(max(damping, DAMPING_RANGE[0]),
                                DAMPING_RANGE[1])
        self.ratios.append(rho)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(convergence_suite.MODELS))
    parser.add_argument('--lrs', default='0.01,0.03,0.1')
    parser.add_argument('--seeds', type=int, default=5)
    parser.add_argument('--interval', type=int, default=5)
    parser.add_argument('--iterations', type=int, default=200)
    parser.add_argument('--batchsize', type=int, default=64)
    args = parser.parse_args()
    harness.limit_threads(1)
    data = convergence_suite.load_digits()
    variants = {'lm_guard': (True, {'factor_interval': 1}),
                'lm_no_guard': (True, {'factor_interval': 1,
                                       'kl_clip': None}),
                'fixed_no_guard': (False, {'factor_interval': 1,
                                           'kl_clip': None})}
    cells = []
    for name, (adapt, options) in variants.items():
        for model_name in args.models.split(','):
            for lr in (float(v) for v in args.lrs.split(',')):
                made = []

                def make():
                    kfac = chainerkfac.optimizers.KFAC(lr=lr, momentum=0.9,
                                                       **options)
                    made.append(LevenbergMarquardt(kfac, args.interval)
                                if adapt else kfac)
                    return made[-1]
                runs = [convergence_suite.run(
                    model_name, make, seed, args.iterations, args.batchsize,
                    data) for seed in range(args.seeds)]
                if adapt:
                    for r, optimizer in zip(runs, made):
                        rhos = numpy.array(optimizer.ratios)
                        r['final_damping'] = optimizer.kfac.damping
                        r['ratios'] = [None if numpy.isnan(v) else v
                                       for v in rhos.tolist()]
                cells.append(convergence_suite.summary(model_name, lr, name,
                                                       runs))
    payload = {
        'interval': args.interval, 'damping_range': DAMPING_RANGE,
        'seeds': args.seeds, 'iterations': args.iterations,
        'batchsize': args.batchsize,
        'kfac_options': {
            name: chainerkfac.optimizers.KFAC(**options).option_values()
            for name, (_, options) in variants.items()},
        'environment': harness.environment(), 'cells': cells}
    print('wrote', harness.write_json('lm_damping.json', payload))


if __name__ == '__main__':
    main()
