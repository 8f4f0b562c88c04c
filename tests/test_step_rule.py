"""The step rule: the user's learning rate and its schedule set K-FAC's
step (:mod:`chainerkfac.step_rule`), checked against MomentumSGD
on the same batches; the dense checks of each rule's formula are in
tests/test_update.py."""
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions
import numpy
import pytest

import chainerkfac
from chainerkfac import step_rule
from tests.device import host, place, send


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(10, 16)
            self.l2 = L.Linear(16, 4)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def batches(steps, n=32, seed=0):
    rng = numpy.random.RandomState(seed)
    teacher = rng.randn(10, 4)
    out = []
    for _ in range(steps):
        x = rng.randn(n, 10).astype(numpy.float32)
        out.append((x, (x @ teacher).argmax(axis=1).astype(numpy.int32)))
    return out


def update_norms(make_optimizer, lr_at, steps=40, seed=0):
    """``‖w_t − w_{t−1}‖`` of every step, the learning rate set to
    ``lr_at(t)`` before update ``t`` (as a schedule extension does)."""
    numpy.random.seed(seed)
    model = place(L.Classifier(MLP()))
    optimizer = make_optimizer()
    optimizer.setup(model)
    norms = []
    for t, (x, y) in enumerate(batches(steps, seed=seed)):
        optimizer.lr = lr_at(t)
        before = [host(p.array).copy() for p in model.params()]
        optimizer.update(model, *send(x, y))
        norms.append(numpy.sqrt(sum(
            ((host(p.array) - b) ** 2).sum()
            for p, b in zip(model.params(), before))))
    return numpy.asarray(norms)


OPTIMIZERS = {
    'momentum_sgd': lambda: chainer.optimizers.MomentumSGD(0.1, 0.9),
    'kfac': lambda: chainerkfac.optimizers.KFAC(0.1, 0.9),
}


def test_learning_rate_and_its_decay_scale_the_step_as_for_momentum_sgd():
    # The measure: the mean update norm at lr 0.1 over that at
    # lr 0.01, and the last steps of a linear decay to 0 over those of a
    # constant lr: K-FAC's ratios within 1.5x of MomentumSGD's (before
    # grafting K-FAC's were 1.00 and 0.97: the guard set every step).
    steps = 40
    ratios = {}
    for name, make in OPTIMIZERS.items():
        high = update_norms(make, lambda t: 0.1, steps)
        low = update_norms(make, lambda t: 0.01, steps)
        decayed = update_norms(make, lambda t: 0.1 * (1 - t / steps), steps)
        ratios[name] = (high.mean() / low.mean(),
                        decayed[-10:].mean() / high[-10:].mean())
    for k in range(2):
        sgd, kfac = ratios['momentum_sgd'][k], ratios['kfac'][k]
        assert 1 / 1.5 < kfac / sgd < 1.5, ratios
    assert ratios['kfac'][0] > 3 and ratios['kfac'][1] < 0.5, ratios


def test_schedule_extensions_change_the_step():
    # ExponentialShift on a Trainer halving the lr every iteration: the
    # last update is shorter than the first as MomentumSGD's is (momentum
    # carries the earlier, longer steps).
    def last_over_first(make):
        numpy.random.seed(0)
        model = L.Classifier(MLP())
        optimizer = make()
        optimizer.setup(model)
        data = [(x[i], y[i]) for x, y in batches(8) for i in range(len(x))]
        iterator = chainer.iterators.SerialIterator(data, 32, shuffle=False)
        updater = training.StandardUpdater(iterator, optimizer)
        trainer = training.Trainer(updater, (8, 'iteration'), out='/tmp')
        trainer.extend(extensions.ExponentialShift('lr', 0.5),
                       trigger=(1, 'iteration'))
        norms = []

        @training.make_extension(trigger=(1, 'iteration'), priority=-1)
        def record(trainer):
            params = [p.array.copy() for p in model.params()]
            if record.previous is not None:
                norms.append(numpy.sqrt(sum(
                    ((a - b) ** 2).sum()
                    for a, b in zip(params, record.previous))))
            record.previous = params
        record.previous = None
        trainer.extend(record)
        trainer.run()
        return norms[-1] / norms[0]

    sgd = last_over_first(OPTIMIZERS['momentum_sgd'])
    kfac = last_over_first(OPTIMIZERS['kfac'])
    assert kfac < 0.8 and 1 / 1.5 < kfac / sgd < 1.5, (sgd, kfac)


def test_rule_scales_from_sums():
    # kl_graft: one ρ² = (B / 64) Σ_b (‖g_b‖² / ‖V_b‖²) ⟨V_b, g_b⟩ /
    # Σ_b ⟨V_b, g_b⟩ for every block, a zero V counting with ρ_b = 1, an
    # unknown batch taken as 64; natural: 1.
    sums = step_rule.Sums.of([[2.0, 4.0, 9.0], [0.0, 0.0, 0.0],
                              [3.0, 1.0, 4.0]])
    rho2 = (9 / 4 * 2 + 4 / 1 * 3) / 5
    for batch, grown in ((None, 1.0), (64, 1.0), (256, 4.0), (32, 0.5)):
        numpy.testing.assert_allclose(
            step_rule.KLGraft().scales(sums, batch),
            [numpy.sqrt(grown * rho2)] * 3, rtol=1e-14)
    assert list(step_rule.KLGraft().scales(sums.without([0, 2]))) == \
        [1.0] * 3
    assert list(step_rule.Natural().scales(sums, 256)) == [1.0] * 3
    # q = η² Σ_b ρ_b² ⟨V_b, g_b⟩ / s²
    assert step_rule.kl_estimate(numpy.array([1.0, 5.0, 2.0]), sums, 0.1,
                                 loss_scale=2.0) == \
        pytest.approx(0.01 * (2.0 + 4 * 3.0) / 4, rel=1e-14)


def test_block_sums():
    # [⟨V, g⟩, ⟨V, V⟩, ⟨g, g⟩], whose rows add up over processes.
    rng = numpy.random.RandomState(0)
    V, g = (rng.normal(size=(2, 3)) for _ in range(2))
    sums = step_rule.Sums.of(numpy.stack(
        [step_rule.block_sums(v, gb) for v, gb in zip(V, g)]))
    numpy.testing.assert_allclose(
        numpy.stack(sums, axis=1),
        [[v @ gb, v @ v, gb @ gb] for v, gb in zip(V, g)], rtol=1e-14)


def test_step_rule_option_is_checked_and_shown():
    with pytest.raises(ValueError,
                       match="step_rule must be one of 'kl_graft'"):
        chainerkfac.optimizers.KFAC(step_rule='sgd')
    optimizer = chainerkfac.optimizers.KFAC()
    assert isinstance(optimizer.step_rule, step_rule.KLGraft)
    assert optimizer.kl_clip == 5e-4 and optimizer.damping == 1e-3
    assert optimizer.option_values()['step_rule'] == "'kl_graft'"
