"""Low-rank preconditioning of Linear layers against the dense product.

Where a Linear's batch has fewer rows than its width, its preconditioned
gradient is taken as ``(G_d⁻¹ Lᵀ)(R A_d⁻¹)`` from the batch's output
gradients ``L`` and inputs ``R`` (``chainerkfac/curvature/low_rank.py``).
Each run below is compared, parameter by parameter after three steps in
float64, with the same run where the dense ``G_d⁻¹ ∇W̄ A_d⁻¹`` is forced
(``low_rank.PAYS_BELOW = 0``), which tests/test_dense_preconditioning.py
checks against dense solves; a spy says whether the low-rank product ran.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac.curvature import forms
from chainerkfac.curvature import low_rank


class MLP(chainer.Chain):
    def __init__(self, bias=True, axes=1, shared=False):
        super().__init__()
        self.axes, self.shared = axes, shared
        with chainer.using_config('dtype', numpy.float64), self.init_scope():
            self.l1 = L.Linear(20, 30, nobias=not bias)
            self.l2 = L.Linear(30, 4)

    def forward(self, x):
        h = F.tanh(self.l1(x, n_batch_axes=self.axes))
        if self.shared:
            # The same layer twice: its output gradients arrive in the
            # reverse order of its inputs.
            h = F.tanh(self.l1(h[..., :20], n_batch_axes=self.axes)) + h
        if self.axes > 1:
            h = F.sum(h, axis=1)
        return self.l2(h)


def batch(step, axes):
    rng = numpy.random.RandomState(step)
    # 6 rows either way: few enough for the low-rank product to pay.
    shape = (2, 3, 20) if axes > 1 else (6, 20)
    return rng.randn(*shape), rng.randint(0, 4, shape[0])


class Spy:
    """Counts the low-rank products of every Kronecker form."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for kind in (forms.KroneckerInverses, forms.KroneckerCholesky):
            original = kind.apply_low_rank

            def counted(form, left, right, original=original):
                self.calls += 1
                return original(form, left, right)
            monkeypatch.setattr(kind, 'apply_low_rank', counted)


def train(monkeypatch, dense, steps=3, model_options=None, loss_term=0.0,
          hook=None, acc_iters=1, loss_scale=None, unused_pass=False,
          **options):
    monkeypatch.setattr(low_rank, 'PAYS_BELOW', 0.0 if dense else 0.75)
    numpy.random.seed(0)
    model = MLP(**(model_options or {}))
    classifier = L.Classifier(model)
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.1, momentum=0.9, acc_iters=acc_iters, **options)
    optimizer.setup(classifier)
    if hook is not None:
        optimizer.add_hook(hook)
    if loss_scale is not None:
        optimizer.loss_scaling(interval=10 ** 9, scale=loss_scale)

    def loss(x, t):
        value = classifier(x, t)
        if unused_pass:
            model(x)  # a training pass that is never backpropagated
        if loss_term:
            value += loss_term * F.sum(model.l1.W ** 2)
        return value

    for step in range(steps):
        x, t = batch(step, model.axes)
        optimizer.update(loss, x, t)
    return {name: p.array.copy() for name, p in model.namedparams()}


CASES = {
    'bias, inverses every 10 steps': ({}, {'factor_interval': 10,
                                           'inverse_interval': 10}),
    'bias, Cholesky factors': ({}, {'factor_interval': 1,
                                    'inverse_interval': 1}),
    'no bias': ({'bias': False}, {}),
    'positions (n_batch_axes=2)': ({'axes': 2}, {}),
    'a layer called twice': ({'shared': True}, {}),
    'natural step': ({}, {'step_rule': 'natural', 'kl_clip': None}),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_low_rank_steps_equal_the_dense_product(case, monkeypatch):
    model_options, options = CASES[case]
    dense = train(monkeypatch, True, model_options=model_options, **options)
    spy = Spy(monkeypatch)
    fast = train(monkeypatch, False, model_options=model_options, **options)
    assert spy.calls >= 2  # l1 on steps 2 and 3 at least
    for name in dense:
        numpy.testing.assert_allclose(fast[name], dense[name], rtol=1e-9,
                                      atol=1e-12, err_msg=name)


@pytest.mark.parametrize('extra', ['acc_iters', 'loss_scale'])
def test_low_rank_under_accumulation_and_loss_scaling(extra, monkeypatch):
    options = {'acc_iters': 2} if extra == 'acc_iters' else \
        {'loss_scale': 128.0}
    dense = train(monkeypatch, True, **options)
    spy = Spy(monkeypatch)
    fast = train(monkeypatch, False, **options)
    assert spy.calls >= 2
    for name in dense:
        numpy.testing.assert_allclose(fast[name], dense[name], rtol=1e-9,
                                      atol=1e-12, err_msg=name)


FALLBACKS = {
    'a WeightDecay hook': {
        'hook': chainer.optimizer_hooks.WeightDecay(1e-2)},
    "K-FAC's weight_decay": {'weight_decay': 1e-2},
    'a loss term on the weights': {'loss_term': 1e-2},
    'a pass without backward': {'unused_pass': True},
}


@pytest.mark.parametrize('case', sorted(FALLBACKS))
def test_what_the_rows_do_not_hold_falls_back_to_dense(case, monkeypatch):
    options = FALLBACKS[case]
    dense = train(monkeypatch, True, **options)
    spy = Spy(monkeypatch)
    fast = train(monkeypatch, False, **options)
    assert spy.calls == 0
    for name in dense:
        numpy.testing.assert_array_equal(fast[name], dense[name], name)


def test_cost_model_keeps_the_dense_product_for_wide_batches():
    # A layer 785 wide in, 1000 out: low rank below about 430 rows.
    assert low_rank.pays(100, 785, 1000)
    assert not low_rank.pays(600, 785, 1000)
    # A narrow head (10 outputs): never.
    assert not low_rank.pays(100, 1001, 10)


def test_describe_gives_each_layers_work_over_its_passes(monkeypatch):
    numpy.random.seed(0)
    model = L.Classifier(MLP())
    optimizer = chainerkfac.optimizers.KFAC(lr=0.1)
    optimizer.setup(model)
    assert 'work' not in optimizer.describe()  # no pass yet
    x, t = batch(0, 1)
    optimizer.update(model, x, t)
    lines = optimizer.describe().splitlines()
    l1 = next(line for line in lines if 'predictor/l1' in line)
    # l1: 6 rows, A 21x21, G 30x30; its passes 6 * 6 * 21 * 30 operations;
    # stale: the low-rank product 2 * 6 * (30² + 21² + 30 * 21) and 10
    # per parameter; refresh: the statistics 2 * 6 * (21² + 30²) and the
    # inverses 2 (21³ + 30³) more.
    passes = 6 * 6 * 21 * 30
    stale = 2 * 6 * (900 + 441 + 630) + 10 * 630
    refresh = stale + 2 * 6 * (441 + 900) + 2 * (21 ** 3 + 30 ** 3)
    assert 'work: stale {:.2f}x, refresh {:.2f}x its passes'.format(
        stale / passes, refresh / passes) in l1
    assert "K-FAC's work per step" in lines[-1]
    total = optimizer.work_estimate()
    assert total.passes == passes + 6 * 6 * 31 * 4
    # With a WeightDecay hook the rows are not the gradient: the dense
    # product, 2 * 30 * 21 * (21 + 30).
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    l1 = next(line for line in optimizer.describe().splitlines()
              if 'predictor/l1' in line)
    dense = 2 * 30 * 21 * 51 + 10 * 630
    assert 'stale {:.2f}x'.format(dense / passes) in l1
