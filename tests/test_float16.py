"""float16 and mixed16 models: statistics, factors and preconditioning in
float32, the loss scale divided out, overflow of the preconditioned
gradient handled by the loss scaling."""
import logging

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac.curvature import base
from tests import snapshot_helpers
from tests.device import host, place, send


class Net(chainer.Chain):
    """A convolution with more output positions per batch (8 x 96 x 96 =
    73,728) than float16 counts exactly or holds (65,504: ``A``'s bias
    entry), BatchNorm (on fewer positions: Chainer's own float16 batch
    moments overflow on the CPU at that size), and a linear head."""

    def __init__(self, dtype):
        super().__init__()
        with chainer.using_config('dtype', dtype), self.init_scope():
            self.conv = L.Convolution2D(1, 2, 3, pad=1)
            self.bn = L.BatchNormalization(2)
            self.fc = L.Linear(2, 3)

    def forward(self, x):
        h = F.average_pooling_2d(F.relu(self.conv(x)), 8)
        return self.fc(F.average_pooling_2d(F.relu(self.bn(h)), 12))


def batch(dtype):
    rng = numpy.random.RandomState(0)
    x = rng.rand(8, 1, 96, 96).astype(dtype)
    return send(x, rng.randint(0, 3, 8).astype(numpy.int32))


def one_step(dtype, loss_scale=None, conv_factors='expanded'):
    """Factors after one step of a model built and run in ``dtype``
    (``chainer.mixed16``: float32 parameters, float16 activations)."""
    numpy.random.seed(0)
    model = place(Net(dtype))
    optimizer = chainerkfac.optimizers.KFAC(lr=0.01, damping=0.1,
                                            conv_factors=conv_factors)
    optimizer.setup(model)
    if loss_scale is not None:
        optimizer.loss_scaling(scale=loss_scale)
    x, t = batch(numpy.float32 if dtype == numpy.float32 else numpy.float16)
    with chainer.using_config('dtype', dtype):
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         x, t)
    return {(block.name, f): block.factor[f] for block in optimizer.blocks
            for f in block.factors}


#: How far a half-precision model's BatchNorm F may be from the float32
#: model's, relative to its largest entry, with the statistics exact (the
#: test below): float16 rounds the BatchNorm input x, |x| ≈ |mean|, to
#: 2^-11 of itself, so x − mean carries 2^-11 r of the std (r = |mean| /
#: std ≈ 14 for this input); the forward's float16 batch moments add as
#: much; F, quadratic in x̂, doubles both: 4 r 2^-11 = 2.7%. Measured: 1.4%
#: on the CPU, 2.0% (float16) and 1.9% (mixed16) on an H200's CuPy kernels.
BATCH_NORM_BOUND = 4 * 14 * 2.0 ** -11


@pytest.mark.parametrize('dtype,conv_factors', [
    (numpy.float16, 'expanded'), (chainer.mixed16, 'expanded'),
    (numpy.float16, 'reduced')])
def test_half_precision_factors_are_float32_and_match(dtype, conv_factors):
    # The float32 model's factors, at a loss scale of 1024 (G sums squares
    # of gradients scaled 1024x: 2^20 times their size, far over float16's
    # range), equal the unscaled ones; the half-precision model's are
    # float32 and finite, equal to those up to float16's rounding.
    expected = one_step(numpy.float32, conv_factors=conv_factors)
    scaled = one_step(numpy.float32, 1024, conv_factors)
    half = one_step(dtype, 1024, conv_factors)
    for key, value in expected.items():
        numpy.testing.assert_allclose(host(scaled[key]), host(value),
                                      rtol=1e-5, err_msg=str(key))
        assert half[key].dtype == numpy.float32, key
        tolerance = (BATCH_NORM_BOUND if key == ('bn', 'F') else 2e-2) * \
            numpy.abs(host(value)).max()
        numpy.testing.assert_allclose(host(half[key]), host(value), rtol=0,
                                      atol=tolerance, err_msg=str(key))
    # A's bias entry: the batch's 73,728 positions, over 8 samples.
    assert host(half[('conv', 'A')])[-1, -1] == 96 * 96


class BatchNormInputs(chainer.FunctionHook):
    """Keeps the BatchNormalization function's input and output gradient,
    in float64, at its backward."""

    def backward_preprocess(self, function, in_data, out_grad):
        if type(function).__name__ == 'BatchNormalization':
            self.x, self.gy = (host(a).astype(numpy.float64)
                               for a in (in_data[0], out_grad[0]))


def test_half_precision_batch_norm_factor_is_exact_for_its_inputs():
    # F from the half-precision x and gy the model computed, against the
    # same in float64. Reusing the forward's float16 batch moments lost
    # 1.6% of F here (|mean| / std = 14 on this input), which with the
    # float16 model's own rounding took it past 2% of the float32 model's
    # F on a GPU.
    numpy.random.seed(0)
    model = place(Net(numpy.float16))
    optimizer = chainerkfac.optimizers.KFAC(lr=0.01, damping=0.1)
    optimizer.setup(model)
    optimizer.loss_scaling(scale=1024)
    inputs = BatchNormInputs()
    with chainer.using_config('dtype', numpy.float16), inputs:
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         *batch(numpy.float16))
    x, gy = inputs.x, inputs.gy / 1024
    n, axes = len(x), (0, 2, 3)
    normalised = (x - x.mean(axis=axes, keepdims=True)) / numpy.sqrt(
        x.var(axis=axes, keepdims=True) + model.bn.eps)
    u = n * (gy * normalised).sum(axis=(2, 3))
    v = n * gy.sum(axis=(2, 3))
    expected = numpy.concatenate([(u * u).mean(axis=0), (v * v).mean(axis=0)])
    block = next(b for b in optimizer.blocks if b.name == 'bn')
    numpy.testing.assert_allclose(host(block.factor['F']), expected,
                                  rtol=1e-4)


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with chainer.using_config('dtype', numpy.float16), self.init_scope():
            self.l1 = L.Linear(6, 5)
            self.l2 = L.Linear(5, 3)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def overflowing_run(dynamic):
    """A float16 MLP whose preconditioned gradient overflows float16 at a
    loss scale that keeps its gradient within float16 (damping 1e-6:
    ``F̂⁻¹`` is large where the curvature is small)."""
    numpy.random.seed(0)
    model = place(MLP())
    optimizer = chainerkfac.optimizers.KFAC(lr=1e-3, damping=1e-6,
                                            kl_clip=None)
    optimizer.setup(model)
    if dynamic:
        optimizer.loss_scaling()  # from 1, doubling every step
    else:
        optimizer.loss_scaling(scale=16384)
    rng = numpy.random.RandomState(0)
    x = send(rng.randn(16, 6).astype(numpy.float16))
    t = send(rng.randint(0, 3, 16).astype(numpy.int32))

    def loss(x, t):
        return F.softmax_cross_entropy(model(x), t)
    return model, optimizer, loss, x, t


def test_overflowing_preconditioned_gradient_halves_a_dynamic_scale(
        caplog):
    model, optimizer, loss, x, t = overflowing_run(dynamic=True)
    scales, kept = [], []
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        for _ in range(20):
            scales.append(optimizer._loss_scale)
            before = [host(p.array).copy() for p in model.params()]
            optimizer.update(loss, x, t)
            kept.append(all(numpy.array_equal(host(p.array), b)
                            for p, b in zip(model.params(), before)))
    # Doubled until the preconditioned gradient overflowed: that step was
    # skipped (the parameters kept), the scale halved, and it then grew as
    # slowly as after an overflowing gradient.
    first = scales.index(max(scales))
    assert kept[first] and not any(kept[:first])
    assert 'overflows float16 at loss scale {:g}'.format(
        scales[first]) in caplog.text
    assert scales[first + 1] == scales[first] / 2
    assert max(scales[first + 1:]) < scales[first]
    for name, p in model.namedparams():
        assert numpy.isfinite(host(p.array)).all(), name


def test_dynamic_loss_scale_resumes():
    # Past the overflow (about step 12), a snapshot; the resumed run goes on
    # from the same loss scale, grown as slowly as after an overflow.
    def run(resume_at=None):
        model, optimizer, loss, x, t = overflowing_run(dynamic=True)
        for step in range(20):
            if step == resume_at:
                fresh = overflowing_run(dynamic=True)
                model, optimizer = snapshot_helpers.reloaded(
                    model, optimizer, lambda: fresh[:2])
                loss, x, t = fresh[2:]
            optimizer.update(loss, x, t)
        return optimizer._loss_scale, [host(p.array) for p in model.params()]

    scale, straight = run()
    resumed_scale, resumed = run(resume_at=16)
    assert resumed_scale == scale
    for a, b in zip(straight, resumed):
        numpy.testing.assert_array_equal(a, b)


def test_overflowing_preconditioned_gradient_at_a_static_scale_names_it():
    model, optimizer, loss, x, t = overflowing_run(dynamic=False)
    before = {name: host(p.array).copy()
              for name, p in model.namedparams()}
    with pytest.raises(base.NonFiniteError,
                       match=r'preconditioned gradient of l\d overflows '
                       'float16 at loss scale 16384'):
        optimizer.update(loss, x, t)
    for name, p in model.namedparams():
        numpy.testing.assert_array_equal(host(p.array), before[name])


@pytest.mark.parametrize('weight_decay', [0.0, 1e-2])
def test_a_loss_scale_changes_nothing_in_double_precision(weight_decay):
    # The scale is divided out of G and of the guard's q, and the paper's
    # weight decay (added to the scaled gradient) is scaled with it.
    def run(loss_scale):
        numpy.random.seed(0)
        with chainer.using_config('dtype', numpy.float64):
            model = place(L.Linear(6, 3))
        optimizer = chainerkfac.optimizers.KFAC(
            lr=0.1, momentum=0.9, weight_decay=weight_decay)
        optimizer.setup(model)
        if loss_scale:
            optimizer.loss_scaling(scale=loss_scale)
        rng = numpy.random.RandomState(0)
        for _ in range(3):
            x, t = send(rng.randn(16, 6), rng.randint(0, 3, 16))
            optimizer.update(
                lambda x, t: F.softmax_cross_entropy(model(x), t), x, t)
        return [host(p.array) for p in model.params()]
    for got, expected in zip(run(1024), run(None)):
        numpy.testing.assert_allclose(got, expected, rtol=1e-12)
