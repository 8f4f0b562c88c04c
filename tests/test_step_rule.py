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


def test_grafted_step_has_momentum_free_sgd_length_per_block():
    # Without momentum (and without the guard), every K-FAC block moves by
    # exactly lr ‖g_b‖, g_b including the WeightDecay hook's term, as
    # MomentumSGD's step would.
    numpy.random.seed(0)
    model = place(L.Classifier(MLP()))
    rate, lr = 1e-2, 0.3
    optimizer = chainerkfac.optimizers.KFAC(lr, momentum=0.0, kl_clip=None,
                                            step_rule='graft')
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(rate))
    for x, y in batches(3):
        reference = model.copy(mode='copy')
        reference.cleargrads()
        reference(*send(x, y)).backward()
        before = {name: host(p.array).copy()
                  for name, p in model.namedparams()}
        optimizer.update(model, *send(x, y))
        for link in ('l1', 'l2'):
            names = ['/predictor/{}/{}'.format(link, p) for p in 'Wb']
            grads = {n: host(p.grad) + rate * host(p.array)
                     for n, p in reference.namedparams() if n in names}
            step = numpy.sqrt(sum(
                ((host(p.array) - before[n]) ** 2).sum()
                for n, p in model.namedparams() if n in names))
            length = lr * numpy.sqrt(sum((g ** 2).sum()
                                         for g in grads.values()))
            numpy.testing.assert_allclose(step, length, rtol=1e-4)


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


def test_graft_scales_from_sums():
    # ρ_b = ‖g_b‖ / ‖V_b‖ from the gathered sums; a zero V stays as it is.
    terms = numpy.array([[2.0, 4.0, 9.0], [0.0, 0.0, 0.0]])
    numpy.testing.assert_allclose(step_rule.Graft().scales(terms),
                                  [1.5, 1.0])
    assert list(step_rule.Natural().scales(terms)) == [1.0, 1.0]


def test_block_sums_with_and_without_the_previous_direction():
    # [⟨V, g⟩, ⟨V, V⟩, ⟨g, g⟩, ⟨g, last⟩], the last 0 where a block has no
    # previous direction, whether no block, some or every block has one.
    rng = numpy.random.RandomState(0)
    V, g, last = (rng.normal(size=(2, 3)) for _ in range(3))
    dense = [[v @ gb, v @ v, gb @ gb, gb @ p]
             for v, gb, p in zip(V, g, last)]
    for given in ([False, False], [True, False], [True, True]):
        terms = step_rule.stack_terms([
            step_rule.block_terms(v, gb, p if here else None)
            for v, gb, p, here in zip(V, g, last, given)])
        expected = numpy.array(dense)
        expected[:, 3] *= given
        numpy.testing.assert_allclose(terms, expected, rtol=1e-14)
    ident = step_rule.stack_terms([step_rule.identity_terms(g[0]),
                                   step_rule.identity_terms(g[1], last[1])])
    gg = (g * g).sum(axis=1)
    numpy.testing.assert_allclose(
        ident, [[gg[0]] * 3 + [0], [gg[1]] * 3 + [g[1] @ last[1]]],
        rtol=1e-14)


def test_graft_average_scales_from_running_averages():
    # ρ_b = sqrt(m_t(‖g_b‖²) / m_t(‖V_b‖²)), m_1 = the first sums, then
    # m_t = 0.99 m_{t-1} + 0.01 x_t; a block whose averaged V is zero
    # keeps ρ = 1. Checked against the averages written out step by step.
    rng = numpy.random.RandomState(0)
    rule = step_rule.get('graft_average')
    vv_avg = gg_avg = None
    for t in range(30):
        terms = rng.uniform(0.1, 5.0, size=(3, 3))
        terms[2] = 0.0  # a block with a zero gradient throughout
        vv, gg = terms[:, 1], terms[:, 2]
        if t == 0:
            vv_avg, gg_avg = vv.copy(), gg.copy()
        else:
            vv_avg = 0.99 * vv_avg + 0.01 * vv
            gg_avg = 0.99 * gg_avg + 0.01 * gg
        expected = [numpy.sqrt(gg_avg[0] / vv_avg[0]),
                    numpy.sqrt(gg_avg[1] / vv_avg[1]), 1.0]
        numpy.testing.assert_allclose(rule.scales(terms), expected,
                                      rtol=1e-12)
    # Its averages survive a snapshot: a rule loaded from it takes the
    # next step's scales as the saved one does.
    saved = chainer.serializers.DictionarySerializer()
    rule.serialize(saved)
    loaded = step_rule.GraftAverage()
    loaded.serialize(chainer.serializers.NpzDeserializer(saved.target))
    terms = rng.uniform(0.1, 5.0, size=(3, 3))
    numpy.testing.assert_array_equal(loaded.scales(terms.copy()),
                                     rule.scales(terms.copy()))
    # A snapshot without averages (saved before the first step, or under
    # another rule) starts them afresh.
    before = chainer.serializers.DictionarySerializer()
    step_rule.GraftAverage().serialize(before)
    for target in (before.target, {}):
        fresh = step_rule.GraftAverage()
        fresh.averages = numpy.ones((3, 2))
        fresh.serialize(chainer.serializers.NpzDeserializer(target))
        assert fresh.averages is None


def test_step_rule_option_is_checked_and_shown():
    with pytest.raises(ValueError, match="step_rule must be one of 'graft'"):
        chainerkfac.optimizers.KFAC(step_rule='sgd')
    optimizer = chainerkfac.optimizers.KFAC()
    assert isinstance(optimizer.step_rule, step_rule.GraftAverage)
    assert optimizer.kl_clip == 1e-2 and optimizer.kl_clip_lr == 0.01
    assert optimizer.option_values()['step_rule'] == "'graft_average'"


class _Block:
    """A block of one parameter whose gradient is its ``grad``, as the
    rule reads a real block's ``V``."""

    def __init__(self, rng, size):
        self.param = chainer.Parameter(rng.normal(size=size))

    def shaped(self):
        return True

    def params(self):
        return [self.param]

    def gradient(self):
        return self.param.grad


def test_noise_cap_caps_graft_average_at_the_measured_signal_fraction():
    # ρ_b = min(ρ_b^avg, (1 − μ) α̂ / η) with α̂ = max(0, m(cross)) / m(vg),
    # cross = Σ_b ⟨g_b,t, V_b,t−1⟩ and vg = Σ_b ⟨V_b,t, g_b,t⟩ averaged
    # from zero at the first step that has a previous direction (decay 0.5
    # here, so that a few steps move them); written out step by step.
    # Gradients
    # share a mean, so the signal fraction is positive, but step 1 takes
    # the opposite one: steps 1 and 2 have negative averages, whose cap
    # is 0, and from step 4 on the average is positive again.
    rng = numpy.random.RandomState(0)
    blocks = [_Block(rng, 5), _Block(rng, 3)]
    hp = chainer.optimizer.Hyperparameter()
    hp.lr, hp.momentum = 0.5, 0.9
    rule, average = step_rule.get('noise_cap'), step_rule.GraftAverage()
    rule.decay = average.decay = 0.5
    mean = [3 * rng.normal(size=5), 3 * rng.normal(size=3)]
    last, m, capped = None, None, 0
    for t in range(30):
        sign = -1 if t == 1 else 1
        g = [sign * mu + rng.normal(size=mu.shape) for mu in mean]
        V = [rng.uniform(0.5, 2.0) * gb for gb in g]
        directions = rule.directions()
        assert (directions is None) == (t == 0)
        terms = step_rule.stack_terms([
            step_rule.block_terms(v, gb, None if t == 0 else directions[b])
            for b, (v, gb) in enumerate(zip(V, g))])
        for block, v in zip(blocks, V):
            block.param.grad = v
        rule.observe(blocks, hp)
        expected = average.scales(terms)
        if last is not None:
            sums = numpy.array([sum(v @ gb for v, gb in zip(V, g)),
                                sum(gb @ p for gb, p in zip(g, last))])
            m = 0.5 * (0 if m is None else m) + 0.5 * sums
            cap = (1 - hp.momentum) * max(m[1], 0) / m[0] / hp.lr
            assert (cap == 0) == (t < 3) or t == 3
            capped += bool((cap < expected).any())
            expected = numpy.minimum(expected, cap)
        numpy.testing.assert_allclose(rule.scales(terms), expected,
                                      rtol=1e-12)
        last = V
        if t == 20:
            # Its state survives a snapshot: the loaded rule takes the
            # next steps' scales as the saved one does.
            saved = chainer.serializers.DictionarySerializer()
            rule.serialize(saved)
            rule = step_rule.NoiseCap()
            rule.decay = 0.5
            rule.serialize(chainer.serializers.NpzDeserializer(saved.target))
    assert capped >= 10, capped


def test_noise_cap_starts_afresh_from_a_snapshot_without_its_state():
    rule = step_rule.NoiseCap()
    rule.signal, rule.last = numpy.ones(2), [numpy.ones(3)]
    rule.serialize(chainer.serializers.NpzDeserializer({}))
    assert rule.signal is None and rule.last is None and \
        rule.averages is None
