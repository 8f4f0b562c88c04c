"""The selected device (``pytest --device``) gives the CPU's results.

Skipped on the CPU itself. Same initial parameters and batches on both
sides: a convolution + BatchNorm + linear model trained for a few K-FAC
steps that refresh factors and inverses, then use them stale.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from tests import device


class ConvNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.fc = L.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(F.max_pooling_2d(h, 2))


def train(model, target, dtype, inverse, steps=6):
    opt = chainerkfac.optimizers.KFAC(
        lr=0.05, momentum=0.9, damping=1e-2, inverse=inverse,
        factor_interval=2, inverse_interval=3)
    opt.setup(model.to_device(target))
    rng = numpy.random.RandomState(1)
    for _ in range(steps):
        x = rng.randn(16, 3, 8, 8).astype(dtype)
        t = rng.randint(0, 5, 16).astype(numpy.int32)
        opt.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                   target.send(x), target.send(t))
    return {n: device.host(p.array) for n, p in model.namedparams()}


# In float32, six steps of rounding differences (other summation orders on
# the GPU) pass through the inverses; eigh of a factor with eigenvalues near
# the damping amplifies them most (seen: 0.5% in a few weights).
@pytest.mark.skipif('not device.on_gpu()', reason='runs with --device=@cupy:N')
@pytest.mark.parametrize('dtype,inverse,rtol', [
    (numpy.float64, 'cholesky', 1e-9), (numpy.float64, 'eigen', 1e-9),
    (numpy.float32, 'cholesky', 1e-3), (numpy.float32, 'eigen', 2e-2)])
def test_gpu_matches_cpu(dtype, inverse, rtol):
    with chainer.using_config('dtype', dtype):
        init = ConvNet()
    results = [train(init.copy(mode='copy'), target, dtype, inverse)
               for target in (chainer.get_device('@numpy'),
                              device.current())]
    for name, cpu in results[0].items():
        gpu = results[1][name]
        numpy.testing.assert_allclose(gpu, cpu, rtol=rtol,
                                      atol=rtol * abs(cpu).max(),
                                      err_msg=name)
