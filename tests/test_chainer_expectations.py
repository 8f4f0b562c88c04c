"""What Chainer users' own code expects of an optimizer (issue #34): a set-up
KFAC pickles and deep-copies into one that trains on exactly as the
original, lazily initialised links that are never called, the set-up
warning of links that fall back to momentum SGD, and errors that name the
problem."""
import copy
import logging
import pickle

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac

from tests import mpi_helpers


class Net(chainer.Chain):
    """Convolution, BatchNorm and a lazily initialised Linear."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(1, 3, 3, pad=1)
            self.bn = L.BatchNormalization(3)
            self.fc = L.Linear(None, 4)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


def batches(n, seed=0):
    rng = numpy.random.RandomState(seed)
    return [(rng.randn(8, 1, 5, 5).astype(numpy.float32),
             rng.randint(0, 4, 8)) for _ in range(n)]


def train(optimizer, data):
    model = optimizer.target
    for x, t in data:
        optimizer.update(
            lambda x, t: F.softmax_cross_entropy(model(x), t), x, t)


def state(optimizer):
    """Parameters, momenta and every block's factors, by name."""
    values = {name: p.array.copy()
              for name, p in optimizer.target.namedparams()}
    values.update({name + '/v': p.update_rule.state['v'].copy()
                   for name, p in optimizer.target.namedparams()})
    for block in optimizer.blocks:
        values.update({'{}/{}'.format(block.name, f): block.factor[f].copy()
                       for f in block.factors})
    return values


def set_up(**options):
    numpy.random.seed(0)
    optimizer = chainerkfac.optimizers.KFAC(lr=0.05, factor_interval=2,
                                            **options)
    optimizer.setup(Net())
    return optimizer


@pytest.mark.parametrize('duplicate', [
    lambda o: pickle.loads(pickle.dumps(o)), copy.deepcopy],
    ids=['pickle', 'deepcopy'])
def test_a_copy_trains_on_exactly_as_the_original(duplicate):
    # Chainer's TestOptimizerPickable, and a deep copy of a set-up
    # optimizer (its model comes along): the copy refreshes its own
    # curvature from its own model's statistics at its own steps.
    data = batches(9)
    original = set_up()
    train(original, data[:3])
    copied = duplicate(original)
    assert copied.target is not original.target
    train(original, data[3:])
    train(copied, data[3:])
    expected, got = state(original), state(copied)
    assert expected.keys() == got.keys()
    for key in expected:
        numpy.testing.assert_array_equal(got[key], expected[key],
                                         err_msg=key)
    assert copied.t == original.t == 9


def test_the_model_alone_pickles_after_setup():
    optimizer = set_up()
    train(optimizer, batches(1))
    model = pickle.loads(pickle.dumps(optimizer.target))
    x, _ = batches(1, seed=1)[0]
    with chainer.using_config('train', False):
        numpy.testing.assert_array_equal(model(x).array,
                                         optimizer.target(x).array)


@pytest.mark.parametrize('given, meant', [
    ('dampening', 'damping'), ('learning_rate', 'lr'),
    ('factor_decay', 'cov_ema_decay'), ('inv_update_steps',
                                        'inverse_interval'),
    ('kl_clp', 'kl_clip')])
def test_a_misspelt_option_names_the_one_meant(given, meant):
    with pytest.raises(TypeError, match=r'unexpected option {}=0\.1: did '
                       r'you mean {}=\?'.format(given, meant)):
        chainerkfac.optimizers.KFAC(**{given: 0.1})
    with pytest.raises(TypeError, match='unexpected option zzz=1 \\(its '
                       'options: lr, momentum, damping'):
        chainerkfac.optimizers.KFAC(zzz=1)


def test_links_that_fall_back_are_named_once_at_setup(caplog):
    model = Net()
    model.add_link('emb', L.EmbedID(3, 2))
    model.add_link('deconv', L.Deconvolution2D(3, 2, 2))
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        chainerkfac.optimizers.KFAC().setup(model)
    messages = [r.getMessage() for r in caplog.records
                if r.name == 'chainerkfac.fallback']
    assert messages == [
        'KFAC: 2 link(s) without curvature follow momentum SGD: deconv (no '
        'Fisher block for Deconvolution2D); emb (no Fisher block for '
        'EmbedID)'], messages
    caplog.clear()
    logging.getLogger('chainerkfac.fallback').setLevel(logging.ERROR)
    try:
        chainerkfac.optimizers.KFAC().setup(model)
    finally:
        logging.getLogger('chainerkfac.fallback').setLevel(logging.NOTSET)
    assert not caplog.records
    chainerkfac.optimizers.KFAC().setup(Net())
    assert not caplog.records


def test_describe_says_which_rank_owns_each_layer():
    result = mpi_helpers.run_mpi(
        2, mpi_helpers.script_path('describe_ranks.py'), timeout=120)
    assert result.returncode == 0, mpi_helpers.describe(result)
    assert 'rank 0: ok' in result.stdout and 'rank 1: ok' in result.stdout


class WithAuxiliaryHead(Net):
    """Net with a lazily initialised head that ``forward`` calls only
    when ``use_aux`` is set (an auxiliary head of a later phase)."""

    def __init__(self):
        super().__init__()
        self.use_aux = False
        with self.init_scope():
            self.aux = L.Linear(None, 4)

    def forward(self, x):
        y = super().forward(x)
        if self.use_aux:
            y = y + self.aux(F.relu(self.bn(self.conv(x))))
        return y


def test_a_lazy_link_never_called_gets_no_curvature_until_it_has_a_shape():
    data = batches(6)
    runs = []
    for model in (Net, WithAuxiliaryHead):
        # The lazily initialised layers draw from NumPy's global generator
        # at their first forward pass.
        numpy.random.seed(0)
        runs.append(chainerkfac.optimizers.KFAC(lr=0.05))
        runs[-1].setup(model())
        train(runs[-1], data[:3])
    plain, lazy = runs
    # The unused head changes nothing and costs nothing.
    params = dict(lazy.target.namedparams())
    for name, p in plain.target.namedparams():
        numpy.testing.assert_array_equal(params[name].array, p.array,
                                         err_msg=name)
    aux = next(b for b in lazy.blocks if b.name == 'aux')
    assert not aux.shaped() and not aux.holds_curvature()
    assert ('aux   K-FAC (A, G), shape set at first forward; no curvature '
            'until then') in lazy.describe()
    # Called from now on: it gets its shape, then its curvature.
    lazy.target.use_aux = True
    train(lazy, data[3:])
    assert aux.shaped() and aux.ready()
    assert 'aux   K-FAC A 76x76, G 4x4' in lazy.describe()


def test_a_lazy_link_never_called_in_a_distributed_run():
    result = mpi_helpers.run_mpi(
        2, mpi_helpers.script_path('lazy_link.py'), timeout=120)
    assert result.returncode == 0, mpi_helpers.describe(result)
    assert 'rank 0: ok' in result.stdout and 'rank 1: ok' in result.stdout
