"""Learning-rate decay, momentum adjustment and warmup damping extensions."""
import chainer
import chainer.links as L
import numpy
import pytest
from chainer import training
from chainer.training import extension

from schemes import DampingWarmup, MomentumAdjustment, PolynomialDecay


class FakeUpdater:
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.epoch_detail = 0.0
        self.iteration = 0

    def get_optimizer(self, name):
        return self.optimizer


class FakeTrainer:
    def __init__(self, optimizer):
        self.updater = FakeUpdater(optimizer)


class Hyperparameters:
    """The attributes the extensions edit (a KFAC optimizer has them)."""
    lr = 0.0
    momentum = 0.0
    damping = 0.0


def test_polynomial_values_by_hand():
    decay = PolynomialDecay(0.1, start=1, end=5, power=2)
    expected = {0: 0.1, 0.5: 0.1, 1: 0.1, 2: 0.1 * 0.75 ** 2,
                3: 0.1 * 0.5 ** 2, 4.5: 0.1 * 0.125 ** 2, 5: 0.0, 7: 0.0}
    for epoch, value in expected.items():
        assert decay.value(epoch) == pytest.approx(value, abs=1e-15)


def test_polynomial_published_4k_row():
    """bs4k: η_0 = 8.18e-3, e_start = 1, e_end = 53, p = 11."""
    decay = PolynomialDecay(8.18e-3, 1, 53, 11)
    assert decay.value(27) == pytest.approx(8.18e-3 * 0.5 ** 11)
    assert decay.value(35) == pytest.approx(8.18e-3 * (18 / 52) ** 11)


def test_polynomial_sets_lr_from_epoch_detail():
    optimizer = Hyperparameters()
    trainer = FakeTrainer(optimizer)
    decay = PolynomialDecay(0.1, 1, 5, 2)
    decay.initialize(trainer)
    assert optimizer.lr == 0.1
    trainer.updater.epoch_detail = 3.0
    decay(trainer)
    assert optimizer.lr == pytest.approx(0.025)


def test_polynomial_rejects_empty_interval():
    with pytest.raises(ValueError):
        PolynomialDecay(0.1, 5, 5, 2)


def test_momentum_adjustment_values():
    optimizer = Hyperparameters()
    trainer = FakeTrainer(optimizer)
    adjust = MomentumAdjustment(0.9)
    optimizer.lr = 1.0
    adjust.initialize(trainer)
    assert optimizer.momentum == 0.9
    # η_t sequence and the m_t = m_0 η_t / η_{t-1} (when η falls) it gives.
    for lr, momentum in ((1.0, 0.9), (0.5, 0.45), (0.25, 0.45),
                         (0.25, 0.9), (0.5, 0.9), (0.1, 0.18)):
        optimizer.lr = lr
        adjust(trainer)
        assert optimizer.momentum == pytest.approx(momentum)


def test_damping_warmup_geometric():
    optimizer = Hyperparameters()
    trainer = FakeTrainer(optimizer)
    warmup = DampingWarmup(1e-2, 1e-4, steps=2)
    warmup.initialize(trainer)
    assert optimizer.damping == pytest.approx(1e-2)
    for iteration, damping in ((1, 1e-3), (2, 1e-4), (3, 1e-4), (100, 1e-4)):
        trainer.updater.iteration = iteration
        warmup(trainer)
        assert optimizer.damping == pytest.approx(damping)


def test_damping_warmup_rejects_bad_arguments():
    with pytest.raises(ValueError):
        DampingWarmup(1e-2, 1e-4, steps=0)


class Record(extension.Extension):
    """Records (lr, momentum) of each update: it runs before the editors."""
    trigger = 1, 'iteration'
    priority = extension.PRIORITY_WRITER

    def __init__(self):
        self.values = []

    def __call__(self, trainer):
        optimizer = trainer.updater.get_optimizer('main')
        self.values.append((optimizer.lr, optimizer.momentum))


def make_trainer(out, iterations):
    """5 updates per epoch; lr decays from epoch 1 to 3."""
    x = numpy.ones((10, 2), numpy.float32)
    t = numpy.zeros(10, numpy.int32)
    dataset = chainer.datasets.TupleDataset(x, t)
    model = L.Classifier(L.Linear(2, 2))
    optimizer = chainer.optimizers.MomentumSGD(lr=1.0, momentum=0.5)
    optimizer.setup(model)
    iterator = chainer.iterators.SerialIterator(dataset, 2, shuffle=False)
    updater = training.StandardUpdater(iterator, optimizer)
    trainer = training.Trainer(updater, (iterations, 'iteration'), out=out)
    trainer.extend(PolynomialDecay(0.1, 1, 3, 2))
    trainer.extend(MomentumAdjustment(0.9))
    record = Record()
    trainer.extend(record)
    return trainer, record


def expected_updates(n):
    lrs = [PolynomialDecay(0.1, 1, 3, 2).value(i / 5) for i in range(n)]
    momenta = [0.9] + [0.9 * b / a if b < a else 0.9
                       for a, b in zip(lrs, lrs[1:])]
    return list(zip(lrs, momenta))


def test_extensions_in_a_trainer(tmp_path):
    trainer, record = make_trainer(str(tmp_path), 15)
    trainer.run()
    numpy.testing.assert_allclose(record.values, expected_updates(15))
    # The momentum is adjusted only while the rate decays (epochs 1 to 3).
    assert record.values[5][1] == 0.9 and record.values[6][1] < 0.9


def test_resumed_run_continues_the_schedules(tmp_path):
    trainer, first = make_trainer(str(tmp_path), 8)
    trainer.run()
    path = str(tmp_path / 'snapshot.npz')
    chainer.serializers.save_npz(path, trainer)
    trainer, second = make_trainer(str(tmp_path), 15)
    chainer.serializers.load_npz(path, trainer)
    trainer.run()
    numpy.testing.assert_allclose(first.values + second.values,
                                  expected_updates(15))
