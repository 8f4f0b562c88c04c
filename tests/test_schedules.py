"""Stale Fisher: statistics and inverses are computed exactly when due."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac import schedules


class CNN(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(1, 3, 3, pad=1)
            self.bn = L.BatchNormalization(3)
            self.fc = L.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


def count_statistics(opt, model, steps, lr_zero_batch=None):
    """Steps on which each block's forward/backward statistics ran."""
    calls = {}
    for block in opt.blocks:
        for kind in ('forward_statistics', 'backward_statistics'):
            original = getattr(block, kind)

            def counted(*args, _original=original, _key=(block.name, kind)):
                calls.setdefault(_key, []).append(opt.t + 1)
                return _original(*args)
            setattr(block, kind, counted)
    rng = numpy.random.RandomState(0)
    fixed = rng.randn(8, 1, 4, 4).astype(numpy.float32)
    for step in range(steps):
        x = fixed if lr_zero_batch else rng.randn(8, 1, 4, 4).astype(
            numpy.float32)
        t = numpy.arange(8) % 4
        opt.update(lambda x, t: F.softmax_cross_entropy(model(x), t), x, t)
    return calls


def test_fixed_interval_computes_statistics_on_due_steps_only():
    model = CNN()
    opt = chainerkfac.optimizers.KFAC(factor_interval=3)
    opt.setup(model)
    calls = count_statistics(opt, model, 10)
    due = [1, 4, 7, 10]
    assert calls[('conv', 'forward_statistics')] == due
    assert calls[('conv', 'backward_statistics')] == due
    assert calls[('fc', 'backward_statistics')] == due
    # BatchNorm's forward pass only keeps moments for its backward pass.
    assert calls[('bn', 'backward_statistics')] == due


def test_separate_intervals_for_a_and_g():
    model = CNN()
    opt = chainerkfac.optimizers.KFAC(factor_interval={'A': 4, 'G': 2})
    opt.setup(model)
    calls = count_statistics(opt, model, 9)
    assert calls[('conv', 'backward_statistics')] == [1, 3, 5, 7, 9]
    # The forward hook runs when either factor is due (G needs its backward
    # hook); A itself is built on 1, 5, 9 only.
    assert calls[('fc', 'forward_statistics')] == [1, 3, 5, 7, 9]
    fc = {b.name: b for b in opt.blocks}['fc']
    assert fc.schedules['A'].last == 9
    assert fc.schedules['G'].last == 9


def test_stale_steps_attach_no_backward_hook(monkeypatch):
    attached = []
    original = chainerkfac.hooks.OutputGradientHook.__init__

    def spy(self, *args):
        attached.append(args[0].name)
        original(self, *args)
    monkeypatch.setattr(chainerkfac.hooks.OutputGradientHook, '__init__', spy)
    model = CNN()
    opt = chainerkfac.optimizers.KFAC(factor_interval=5)
    opt.setup(model)
    count_statistics(opt, model, 4)
    assert sorted(attached) == ['bn', 'conv', 'fc']  # step 1 only


def test_inverse_interval_and_callable_schedule():
    model = CNN()
    opt = chainerkfac.optimizers.KFAC(
        factor_interval=lambda t: 1 if t <= 3 else 2, inverse_interval=4)
    opt.setup(model)
    inverse_steps = []
    reporter = chainer.Reporter()
    rng = numpy.random.RandomState(0)
    for _ in range(10):
        observation = {}
        with reporter.scope(observation):
            opt.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                       rng.randn(8, 1, 4, 4).astype(numpy.float32),
                       numpy.arange(8) % 4)
        if observation['kfac/inverse_refreshes']:
            inverse_steps.append(opt.t)
    assert inverse_steps == [1, 5, 9]
    assert {b.name: b for b in opt.blocks}['fc'].schedules['A'].last == 9


def test_adaptive_interval_widens_when_factors_stay():
    model = CNN()
    opt = chainerkfac.optimizers.KFAC(
        lr=0.0, cov_ema_decay=0.0,
        factor_interval=schedules.Adaptive(threshold=1e-3, max_interval=8))
    opt.setup(model)
    calls = count_statistics(opt, model, 20, lr_zero_batch=True)
    # Identical batches and frozen weights: change rate 0 after the first.
    assert calls[('fc', 'backward_statistics')] == [1, 2, 4, 8, 16]


def test_default_intervals_are_adaptive():
    model = CNN()
    opt = chainerkfac.optimizers.KFAC(lr=0.0, cov_ema_decay=0.0)
    opt.setup(model)
    assert all(isinstance(policy, schedules.Adaptive)
               for policy in opt.factor_interval.values())
    calls = count_statistics(opt, model, 20, lr_zero_batch=True)
    # Adaptive()'s growth of 2, from 1: refreshes at 1, 2, 4, 8, 16.
    assert calls[('fc', 'forward_statistics')] == [1, 2, 4, 8, 16]


def test_fixed_interval_snapshot_resumes_with_adaptive_intervals(tmp_path):
    # A snapshot of the former default (factors every step) holds no
    # adaptive interval: the adaptive one restarts from min_interval.
    def make(**options):
        numpy.random.seed(0)
        model = CNN()
        opt = chainerkfac.optimizers.KFAC(lr=0.0, cov_ema_decay=0.0,
                                          **options)
        opt.setup(model)
        return model, opt
    model, opt = make(factor_interval=1)
    count_statistics(opt, model, 3, lr_zero_batch=True)
    path = str(tmp_path / 'snapshot.npz')
    chainer.serializers.save_npz(path, opt)
    model, opt = make()
    chainer.serializers.load_npz(path, opt)
    assert opt.t == 3
    assert {s.interval for b in opt.blocks for s in b.schedules.values()} \
        == {1}
    calls = count_statistics(opt, model, 6, lr_zero_batch=True)
    assert calls[('fc', 'forward_statistics')] == [4, 6]


def test_loaded_adaptive_interval_stays_within_the_policy():
    saved = schedules.RefreshSchedule(schedules.Adaptive(max_interval=50))
    saved.mark(1)
    saved.interval = 50
    snapshot = {}
    saved.serialize(chainer.serializers.DictionarySerializer(snapshot))
    loaded = schedules.RefreshSchedule(schedules.Adaptive(max_interval=10))
    loaded.serialize(chainer.serializers.NpzDeserializer(snapshot))
    assert (loaded.last, loaded.interval) == (1, 10)


def test_stale_fisher_schedule_values():
    s = schedules.StaleFisher(warmup=500, growth_period=100, max_interval=5)
    assert [s(t) for t in (1, 500, 501, 599, 600, 700, 10 ** 6)] == \
        [1, 1, 1, 1, 2, 3, 5]


@pytest.mark.parametrize('bad', [0, -2, 1.5, True, 'x'])
def test_bad_intervals(bad):
    with pytest.raises((ValueError, TypeError)):
        chainerkfac.optimizers.KFAC(factor_interval=bad)


def test_callable_returning_bad_interval_names_it():
    model = CNN()
    opt = chainerkfac.optimizers.KFAC(factor_interval=lambda t: 0)
    opt.setup(model)
    with pytest.raises(ValueError, match='returned 0 at iteration'):
        count_statistics(opt, model, 2)


@pytest.mark.parametrize('factor_interval,inverse_interval,reuse', [
    (1, 1, 1),
    (10, 1, 10),            # inverses wait for the factors to change
    (10, 100, 100),
    ({'A': 1, 'G': 10}, 4, 4),
    (1, lambda t: 3 if t < 50 else 30, 3),
])
def test_inverse_reuse(factor_interval, inverse_interval, reuse):
    opt = chainerkfac.optimizers.KFAC(factor_interval=factor_interval,
                                      inverse_interval=inverse_interval)
    opt.setup(L.Linear(3, 2))
    assert opt.blocks[0].inverse_reuse(1) == reuse


def test_initial_inverse_reuse_ignores_adapted_state():
    # Distributed K-FAC places blocks by the first iteration's reuse, which
    # must not change when a run resumes with adapted intervals.
    opt = chainerkfac.optimizers.KFAC(
        factor_interval=schedules.Adaptive(min_interval=2),
        inverse_interval=lambda t: 1 if t < 50 else 30)
    opt.setup(L.Linear(3, 2))
    block = opt.blocks[0]
    for f in block.factors:
        block.schedules[f].mark(1, change_rate=0.0)
    assert block.inverse_reuse(1) == 4
    assert block.inverse_reuse(60) == 30
    assert block.inverse_reuse() == 2
