"""Polyak averaging (chainerkfac.averaging): the numbers of the average,
evaluation under it, snapshots, with MomentumSGD and K-FAC alike.

The distributed case (every rank holds the same average) is
tests/mpi_scripts/polyak_averaging.py, run by the last test here."""
import chainer
import chainer.links as L
import numpy
import pytest
from chainer import training
from chainer.training import extensions

import chainerkfac
from tests import device
from tests import mpi_helpers
from tests.rank_checks import BatchNormMLP

DECAY = 0.9


def make_optimizer(name):
    if name == 'sgd':
        return chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    return chainerkfac.optimizers.KFAC(lr=0.1, momentum=0.9)


def batches(n, seed=0):
    rng = numpy.random.RandomState(seed)
    return [(rng.randn(16, 3).astype(numpy.float32),
             rng.randint(0, 2, 16).astype(numpy.int32)) for _ in range(n)]


def setup(name, seed=0):
    numpy.random.seed(seed)
    model = device.place(L.Classifier(BatchNormMLP()))
    optimizer = make_optimizer(name)
    optimizer.setup(model)
    return model, optimizer


def step(model, optimizer, batch):
    optimizer.update(model, *device.send(*batch))


def snapshot(model):
    """``{name: host copy}`` of the averaged arrays of ``model``."""
    arrays = {name: p.array for name, p in model.namedparams()}
    bn = model.predictor.bn
    arrays['/predictor/bn/avg_mean'] = bn.avg_mean
    arrays['/predictor/bn/avg_var'] = bn.avg_var
    return {name: numpy.array(device.host(a)) for name, a in arrays.items()}


@pytest.mark.parametrize('name', ['sgd', 'kfac'])
def test_average_is_the_debiased_ema_of_the_recorded_weights(name):
    model, optimizer = setup(name)
    averaging = chainerkfac.PolyakAveraging(model, DECAY)
    recorded = []
    for batch in batches(7):
        step(model, optimizer, batch)
        averaging.update()
        recorded.append(snapshot(model))
    assert averaging.count == 7
    assert len(averaging._averages) == len(recorded[0]) == 8
    for key in recorded[0]:
        z = numpy.zeros_like(recorded[0][key], dtype=numpy.float64)
        for weights in recorded:
            z = DECAY * z + (1 - DECAY) * weights[key]
        numpy.testing.assert_allclose(
            device.host(averaging._averages[key]), z / (1 - DECAY ** 7),
            rtol=1e-5, atol=1e-6, err_msg=key)
    # The first average is the first weights: debiased from the start.
    first = chainerkfac.PolyakAveraging(model, 0.999)
    first.update()
    for key, value in snapshot(model).items():
        numpy.testing.assert_array_equal(
            device.host(first._averages[key]), value, err_msg=key)


def test_averaged_swaps_the_average_in_and_the_live_values_back():
    model, optimizer = setup('sgd')
    averaging = chainerkfac.PolyakAveraging(model, DECAY)
    for batch in batches(3):
        step(model, optimizer, batch)
        averaging.update()
    live = snapshot(model)
    x = device.send(batches(1, seed=1)[0][0])
    with averaging.averaged():
        inside = snapshot(model)
        with chainer.using_config('train', False):
            averaged_scores = device.host(model.predictor(x).array)
    for key, value in inside.items():
        numpy.testing.assert_array_equal(
            value, device.host(averaging._averages[key]), err_msg=key)
        assert not numpy.array_equal(value, live[key]), key
    for key, value in snapshot(model).items():
        numpy.testing.assert_array_equal(value, live[key], err_msg=key)
    # The averaged scores are those of a model holding the averages.
    other = device.place(L.Classifier(BatchNormMLP()))
    for name, param in other.namedparams():
        param.array[...] = averaging._averages[name]
    other.predictor.bn.avg_mean[...] = \
        averaging._averages['/predictor/bn/avg_mean']
    other.predictor.bn.avg_var[...] = \
        averaging._averages['/predictor/bn/avg_var']
    with chainer.using_config('train', False):
        numpy.testing.assert_array_equal(
            averaged_scores, device.host(other.predictor(x).array))
    # Restored on an exception too.
    with pytest.raises(KeyError):
        with averaging.averaged():
            raise KeyError('evaluation failed')
    for key, value in snapshot(model).items():
        numpy.testing.assert_array_equal(value, live[key], err_msg=key)


def test_float16_weights_keep_a_float32_average():
    model = device.place(L.Linear(2, 2))
    for param in model.params():
        param.array = param.array.astype(numpy.float16)
    averaging = chainerkfac.PolyakAveraging(model, 0.99)
    averaging.update()
    for param in model.params():
        param.array += numpy.float16(1e-3)
    averaging.update()
    assert {a.dtype for a in averaging._averages.values()} == {
        numpy.dtype(numpy.float32)}
    with averaging.averaged():
        assert {p.array.dtype for p in model.params()} == {
            numpy.dtype(numpy.float16)}


def test_arguments_and_order():
    model = L.Linear(2, 2)
    for decay in (1.0, -0.1, '0.9', None):
        with pytest.raises(ValueError, match='decay'):
            chainerkfac.PolyakAveraging(model, decay)
    with pytest.raises(RuntimeError, match='first update'):
        with chainerkfac.PolyakAveraging(model).averaged():
            pass


def make_trainer(name, out, stop, seed=0, average=True):
    """MomentumSGD or K-FAC under a Trainer that averages (unless not
    ``average``), evaluates the live and the averaged model every 2
    iterations and snapshots at 3."""
    model, optimizer = setup(name, seed)
    data = chainer.datasets.TupleDataset(*[
        numpy.concatenate(a) for a in zip(*batches(4))])
    it = chainer.iterators.SerialIterator(data, 16, shuffle=False)
    trainer = training.Trainer(
        training.StandardUpdater(it, optimizer, device=device.current()),
        (stop, 'iteration'), out=out)
    averaging = chainerkfac.PolyakAveraging(model, DECAY)
    val = chainer.iterators.SerialIterator(data, 64, repeat=False,
                                           shuffle=False)
    trainer.extend(extensions.Evaluator(val, model, device=device.current()),
                   trigger=(2, 'iteration'))
    if average:
        trainer.extend(averaging)
        trainer.extend(chainerkfac.AveragedEvaluator(
            averaging, val, model, device=device.current()),
            trigger=(2, 'iteration'))
    trainer.extend(extensions.LogReport(trigger=(2, 'iteration')))
    trainer.extend(extensions.snapshot(), trigger=(3, 'iteration'))
    return trainer, model, averaging, data


def observed(observation, key):
    """A reported value as a host float."""
    value = observation[key]
    return float(device.host(getattr(value, 'array', value)))


@pytest.mark.parametrize('name', ['sgd', 'kfac'])
def test_trainer_snapshot_resumes_the_average_bit_for_bit(name, tmp_path):
    straight, model, averaging, data = make_trainer(
        name, str(tmp_path / 'straight'), 6)
    straight.run()
    log = straight.observation
    # The averaged evaluator of iteration 6 saw the average of iteration 6.
    with averaging.averaged(), chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        x, t = chainer.dataset.concat_examples(data, device.current())
        expected = float(device.host(model(x, t).array))
    averaged_loss = observed(log, 'validation_averaged/main/loss')
    assert averaged_loss == pytest.approx(expected, rel=1e-6)
    assert averaged_loss != observed(log, 'validation/main/loss')

    cut, _, _, _ = make_trainer(name, str(tmp_path / 'cut'), 3)
    cut.run()
    resumed, resumed_model, resumed_averaging, _ = make_trainer(
        name, str(tmp_path / 'resumed'), 6, seed=1)
    chainer.serializers.load_npz(
        str(tmp_path / 'cut' / 'snapshot_iter_3'), resumed)
    assert resumed_averaging.count == 3
    resumed.run()
    assert resumed_averaging.count == averaging.count == 6
    assert set(resumed_averaging._averages) == set(averaging._averages)
    for key, value in averaging._averages.items():
        numpy.testing.assert_array_equal(
            device.host(resumed_averaging._averages[key]),
            device.host(value), err_msg=key)
    assert observed(resumed.observation,
                    'validation_averaged/main/loss') == averaged_loss


@pytest.mark.parametrize('name', ['sgd', 'kfac'])
def test_every_rank_holds_the_same_average_under_mpiexec(name):
    mpi_helpers.run_mpi(2, mpi_helpers.script_path('polyak_averaging.py'),
                        [name], timeout=120, check=True)


def test_a_parameter_first_seen_late_averages_its_own_weights():
    # fc2's weights exist from its first forward pass, after one update:
    # its average is that of its own iterates (started at zero, the first
    # update's fold would have halved it).
    class Late(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.fc1 = L.Linear(3, 4)
                self.fc2 = L.Linear(None, 2)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(h) if self.fc2.W.array is not None or \
                self.grown else h[:, :2]

    numpy.random.seed(0)
    net = Late()
    net.grown = False
    model = device.place(L.Classifier(net))
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1)
    optimizer.setup(model)
    averaging = chainerkfac.PolyakAveraging(model, DECAY)
    data = batches(4)
    step(model, optimizer, data[0])
    averaging.update()
    net.grown = True
    recorded = []
    for batch in data[1:]:
        step(model, optimizer, batch)
        averaging.update()
        recorded.append(numpy.array(device.host(net.fc2.W.array)))
    weights = DECAY ** numpy.arange(len(recorded))[::-1] * (1 - DECAY)
    expected = sum(w * r for w, r in zip(weights, recorded)) / weights.sum()
    with averaging.averaged():
        numpy.testing.assert_allclose(device.host(net.fc2.W.array), expected,
                                      rtol=1e-6)


def test_snapshot_without_the_average_starts_it_afresh(tmp_path, caplog):
    # A Trainer snapshot written before the extension was added loads; the
    # average starts at the next iteration.
    trainer, _, _, _ = make_trainer('sgd', str(tmp_path / 'plain'), 3,
                                    average=False)
    trainer.run()
    resumed, _, averaging, _ = make_trainer('sgd', str(tmp_path / 'more'), 4)
    with caplog.at_level('WARNING', logger='chainerkfac'):
        chainer.serializers.load_npz(
            str(tmp_path / 'plain' / 'snapshot_iter_3'), resumed)
    assert 'holds no Polyak average' in caplog.text
    resumed.run()
    assert averaging.count == 1
