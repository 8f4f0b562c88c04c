"""Default K-FAC at MomentumSGD's learning rates: no divergence, and a
divergence that stays finite is never silent.

The models and the digits split are benchmarks/convergence_suite.py's,
whose full grid (200 iterations, more seeds) measures the same in
docs/benchmarks.md; here a few short runs check the behaviour.
"""
import os
import sys
import warnings

import chainer
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac import divergence

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..',
                                'benchmarks'))
import convergence_suite  # NOQA  (after the path)


@pytest.fixture(scope='module')
def digits():
    return convergence_suite.load_digits()


def losses(model_name, optimizer, data, steps=40, seed=0):
    """Training losses of ``steps`` updates, and the warnings raised."""
    (x, y), _ = data
    factory, flat = convergence_suite.MODELS[model_name]
    if flat:
        x = x.reshape(len(x), -1)
    numpy.random.seed(seed)
    model = L.Classifier(factory())
    optimizer.setup(model)
    rng = numpy.random.RandomState(seed)
    result = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(steps):
            idx = rng.choice(len(x), 64, replace=False)
            optimizer.update(model, x[idx], y[idx])
            result.append(float(model.loss.array))
    return numpy.asarray(result), [w for w in caught if issubclass(
        w.category, divergence.DivergenceWarning)]


@pytest.mark.parametrize('model_name', ['mlp', 'cnn'])
@pytest.mark.parametrize('lr', [0.03, 0.1])
def test_default_kfac_does_not_diverge_at_momentum_sgd_learning_rates(
        digits, model_name, lr):
    sgd, _ = losses(model_name, chainer.optimizers.MomentumSGD(lr, 0.9),
                    digits)
    kfac, warned = losses(model_name, chainerkfac.optimizers.KFAC(lr, 0.9),
                          digits)
    # MomentumSGD trains the CNN at 0.03 and spikes to 2.3 times its first
    # loss at 0.1; K-FAC does neither, and ends lower.
    assert kfac.max() < 1.5 * kfac[0], kfac
    assert kfac[-5:].mean() < min(0.5 * kfac[0], sgd[-5:].mean()), kfac
    assert not warned


def test_unguarded_finite_divergence_is_warned_once_or_raised(digits):
    # The CNN without BatchNorm at lr 0.1 without the guard: the loss
    # grows by orders of magnitude while every value stays finite.
    trace, warned = losses(
        'cnn', chainerkfac.optimizers.KFAC(0.1, 0.9, kl_clip=None), digits)
    assert numpy.isfinite(trace).all() and trace.max() > 100 * trace[0]
    assert len(warned) == 1
    message = str(warned[0].message)
    assert 'training loss' in message and 'learning rate' in message
    with pytest.raises(chainerkfac.DivergenceError, match='iteration'):
        losses('cnn', chainerkfac.optimizers.KFAC(
            0.1, 0.9, kl_clip=None, divergence='raise'), digits)


def test_hard_clipping_for_many_steps_is_a_sign_of_divergence():
    monitor = divergence.DivergenceMonitor('raise')
    for step in range(divergence.PATIENCE - 1):
        monitor.observe(step, 2.0, update_scale=1e-4)
    monitor.observe(step, 2.0, update_scale=0.5)  # the count restarts
    for step in range(divergence.PATIENCE - 1):
        monitor.observe(step, 2.0, update_scale=1e-4)
    with pytest.raises(chainerkfac.DivergenceError, match='guard'):
        monitor.observe(step, 2.0, update_scale=1e-4)


def test_guard_options_are_checked():
    with pytest.raises(ValueError, match='kl_clip'):
        chainerkfac.optimizers.KFAC(kl_clip=0)
    with pytest.raises(ValueError, match='divergence'):
        chainerkfac.optimizers.KFAC(divergence='ignore')
    assert chainerkfac.optimizers.KFAC(kl_clip=None).kl_clip is None
