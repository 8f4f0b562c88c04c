"""Convolution and BatchNorm preconditioning against dense solves.

One step of a small CNN (convolution, BatchNorm, linear head) in float64,
checked parameter by parameter against ``(F̂ + damping)⁻¹ ∇`` built from
explicit Kronecker products and dense matrices: for the convolution
``(A + π√ε I) ⊗ (G + √ε/π I)`` (``inverse='cholesky'``, Martens & Grosse
2015 §6.3) or ``A ⊗ G + ε I`` (``inverse='eigen'``, exact damping), for
BatchNorm ``F + m ε I`` with ``m`` the ``bn_damping_multiplier`` and ``F``
the full (γ, β) Fisher or its diagonal (Osawa et al. 2019 §4.1). The
factors are the blocks' own (tests/test_factors.py checks them against
per-sample brute force); the gradients come from an independent copy.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from tests import brute_force
from tests.device import host, place, send


class CNN(chainer.Chain):
    def __init__(self):
        super().__init__()
        with chainer.using_config('dtype', numpy.float64), self.init_scope():
            self.conv = L.Convolution2D(2, 3, 3, pad=1)
            self.bn = L.BatchNormalization(3)
            self.fc = L.Linear(3 * 5 * 5, 4)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


def gradients(model, x, t):
    """Raw gradients of a copy of ``model`` on (x, t), on the CPU."""
    ref = CNN()
    ref.copyparams(model)
    ref.cleargrads()
    F.softmax_cross_entropy(ref(x), t).backward()
    return {name: host(p.grad) for name, p in ref.namedparams()}


@pytest.mark.parametrize('inverse', ['cholesky', 'eigen'])
@pytest.mark.parametrize('bn_fisher', ['diagonal', 'full'])
@pytest.mark.parametrize('multiplier', [1.0, 64.0])
def test_conv_and_batch_norm_steps_equal_dense_solves(inverse, bn_fisher,
                                                      multiplier):
    damping, lr = 1e-2, 0.1
    numpy.random.seed(0)
    model = place(CNN())
    optimizer = chainerkfac.optimizers.KFAC(
        lr=lr, momentum=0.0, damping=damping, inverse=inverse,
        bn_fisher=bn_fisher, bn_damping_multiplier=multiplier,
        step_rule='natural', kl_clip=None)
    optimizer.setup(model)
    rng = numpy.random.RandomState(0)
    x, t = rng.randn(8, 2, 5, 5), rng.randint(0, 4, 8)
    before = {name: host(p.array).copy() for name, p in model.namedparams()}
    grads = gradients(model, x, t)
    optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                     *send(x, t))
    blocks = {block.name: block for block in optimizer.blocks}
    assert set(blocks) == {'conv', 'bn', 'fc'}

    for name in ('conv', 'fc'):
        A = host(blocks[name].factor['A'])
        G = host(blocks[name].factor['G'])
        W = before['/{}/W'.format(name)]
        grad = numpy.concatenate(
            [grads['/{}/W'.format(name)].reshape(len(W), -1),
             grads['/{}/b'.format(name)][:, None]], axis=1)
        if inverse == 'cholesky':
            dense = numpy.kron(*brute_force.factored_damping(A, G, damping))
        else:
            dense = numpy.kron(A, G) + damping * numpy.eye(len(A) * len(G))
        V = brute_force.unvec(numpy.linalg.solve(dense, brute_force.vec(
            grad)), grad.shape)
        link = getattr(model, name)
        numpy.testing.assert_allclose(
            host(link.W.array), W - lr * V[:, :-1].reshape(W.shape),
            rtol=1e-5, atol=1e-5 * abs(W).max(), err_msg=name)
        b = before['/{}/b'.format(name)]
        numpy.testing.assert_allclose(
            host(link.b.array), b - lr * V[:, -1], rtol=1e-5,
            atol=1e-5 * abs(b).max(), err_msg=name)

    F_bn = host(blocks['bn'].factor['F'])
    if bn_fisher == 'diagonal':
        assert F_bn.shape == (6,)
        F_bn = numpy.diag(F_bn)
    grad = numpy.concatenate([grads['/bn/gamma'], grads['/bn/beta']])
    V = numpy.linalg.solve(F_bn + multiplier * damping * numpy.eye(6), grad)
    for name, part in (('gamma', V[:3]), ('beta', V[3:])):
        value = before['/bn/' + name]
        numpy.testing.assert_allclose(
            host(getattr(model.bn, name).array), value - lr * part,
            rtol=1e-5, atol=1e-5 * abs(value).max(), err_msg=name)
