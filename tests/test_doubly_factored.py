"""The doubly-factored block of a Linear with a large feature-map input
(Ba, Grosse & Martens 2017 §4-4.1) against brute force: each sample's
rank-1 SVD, the three factors, Eq. 12's π's, and the step of Eq. 9 against
a dense solve with the explicit Kronecker product of the three damped
factors (the bias's block ``G + ε I`` beside it)."""
import math

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac import linalg
from chainerkfac.curvature import doubly_factored
from tests.device import host, place


C, H, W, OUT = 3, 2, 3, 4          # T = 6 positions, an 18-wide input


class Net(chainer.Chain):
    def __init__(self, nobias=False):
        super().__init__()
        with chainer.using_config('dtype', numpy.float64), self.init_scope():
            self.conv = L.Convolution2D(2, C, 3, pad=1)
            self.fc = L.Linear(C * H * W, OUT, nobias=nobias)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)))


def batch(n=10, seed=0):
    rng = numpy.random.RandomState(seed)
    return rng.randn(n, 2, H, W), rng.randint(0, OUT, n)


def three_factor_damping(factors, damping):
    """Eq. 12 as written: π_a = ((‖A‖*/d_A)² / (‖B‖*/d_B ‖C‖*/d_C))^(1/3),
    the nuclear norm of a PSD factor its trace."""
    means = [numpy.trace(M) / len(M) for M in factors]
    return [(means[i] ** 2 / numpy.prod(means[:i] + means[i + 1:]))
            ** (1 / 3) * damping ** (1 / 3) for i in range(3)]


def brute_force_statistics(model, x, t):
    """K, Ψ (from numpy's SVD of each sample's C x T input) and G (from
    each sample's output gradient, ĝ = n ∂L/∂s) of ``model.fc``."""
    n = len(x)
    h = F.relu(model.conv(x)).array.reshape(n, C, H * W)
    K, Psi = 0, 0
    for X in h:
        u, s, vt = numpy.linalg.svd(X)
        psi, k = math.sqrt(s[0]) * u[:, 0], math.sqrt(s[0]) * vt[0]
        K, Psi = K + numpy.outer(k, k) / n, Psi + numpy.outer(psi, psi) / n
    G = 0
    for i in range(n):
        s = chainer.Variable(model.fc(h[i:i + 1].reshape(1, C, H, W)).array)
        F.softmax_cross_entropy(s, t[i:i + 1]).backward()
        G = G + numpy.outer(s.grad[0], s.grad[0]) / n
    return K, Psi, G


@pytest.mark.parametrize('shape', [(5, 7, 3), (5, 3, 7), (4, 4, 4)])
def test_rank_one_factors_are_the_top_singular_triple(shape):
    X = numpy.random.RandomState(1).randn(*shape)
    X[2] = 0   # an all-zero sample gives zeros
    k, psi = doubly_factored.rank_one_factors(X)
    assert k.shape == (shape[2], shape[0]) and psi.shape == shape[:2][::-1]
    for i in range(shape[0]):
        u, s, vt = numpy.linalg.svd(X[i])
        numpy.testing.assert_allclose(numpy.outer(psi[:, i], k[:, i]),
                                      s[0] * numpy.outer(u[:, 0], vt[0]),
                                      atol=1e-12)
        # The rank-1 approximation split evenly: ‖ψ‖ = ‖k‖ = √σ.
        numpy.testing.assert_allclose(
            [psi[:, i] @ psi[:, i], k[:, i] @ k[:, i]], [s[0], s[0]],
            atol=1e-12)


def test_three_pis_follow_eq_12_and_reduce_to_two_factor_damping():
    rng = numpy.random.RandomState(2)
    factors = []
    for d, scale in ((6, 3.0), (3, 0.01), (4, 50.0)):
        M = rng.randn(d, 2 * d) * scale
        factors.append(M @ M.T)
    got = linalg.factored_damping(factors, 1e-3)
    numpy.testing.assert_allclose(got, three_factor_damping(factors, 1e-3),
                                  rtol=1e-12)
    assert numpy.prod(got) == pytest.approx(1e-3, rel=1e-12)
    A, G = factors[:2]
    pi = math.sqrt((numpy.trace(A) / 6) / (numpy.trace(G) / 3))
    numpy.testing.assert_allclose(
        linalg.factored_damping((A, G), 1e-3),
        (pi * math.sqrt(1e-3), math.sqrt(1e-3) / pi), rtol=1e-12)
    # A zero factor: π = 1, each factor still damped.
    assert linalg.factored_damping((A, 0 * G, A), 8.0) == \
        pytest.approx((2.0, 2.0, 2.0))


@pytest.mark.parametrize('nobias', [False, True])
def test_factors_equal_brute_force_and_step_equals_dense_solve(nobias):
    """K, Ψ and G after one step; the update against
    ``(K_d ⊗ Ψ_d ⊗ G_d)⁻¹ vec ∇W`` and ``(G + ε I)⁻¹ ∇b``."""
    damping, lr = 1e-2, 0.1
    numpy.random.seed(0)
    model = place(Net(nobias))
    optimizer = chainerkfac.optimizers.KFAC(
        lr=lr, momentum=0.0, damping=damping, step_rule='natural',
        kl_clip=None, factor_interval=1, doubly_factored_from=C * H * W)
    optimizer.setup(model)
    block = optimizer.blocks[1]
    assert type(block) is doubly_factored.DoublyFactoredBlock
    x, t = batch()
    reference = Net(nobias)
    reference.copyparams(model)
    K, Psi, G = brute_force_statistics(reference, x, t)
    reference.cleargrads()
    F.softmax_cross_entropy(reference(x), t).backward()
    before = host(model.fc.W.array).copy()
    optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                     *map(chainer.get_device(model.device).send, (x, t)))
    for name, expected in (('K', K), ('Psi', Psi), ('G', G)):
        numpy.testing.assert_allclose(host(block.factor[name]), expected,
                                      rtol=1e-10, atol=1e-12,
                                      err_msg=name)
    assert block.describe() == (
        'doubly-factored K-FAC Psi 3x3, K 6x6, G 4x4' +
        ('' if nobias else ', bias block 4x4'))
    K_d, Psi_d, G_d = (M + d * numpy.eye(len(M)) for M, d in zip(
        (K, Psi, G), three_factor_damping((K, Psi, G), damping)))
    # ∇W as (out, C, T) flattened row-major, so NumPy's kron in the order
    # G, Ψ, K (the package's column-major order: Ψ ⊗ K ⊗ G).
    dense = numpy.kron(numpy.kron(G_d, Psi_d), K_d)
    grad_W = reference.fc.W.grad
    expected_W = numpy.linalg.solve(dense, grad_W.ravel()).reshape(
        grad_W.shape)
    numpy.testing.assert_allclose((before - host(model.fc.W.array)) / lr,
                                  expected_W, rtol=1e-8)
    if not nobias:
        expected_b = numpy.linalg.solve(G + damping * numpy.eye(OUT),
                                        reference.fc.b.grad)
        numpy.testing.assert_allclose(
            (host(reference.fc.b.array) - host(model.fc.b.array)) / lr,
            expected_b, rtol=1e-8)


def test_block_is_chosen_by_input_width_at_setup():
    def block_types(threshold, in_size=C * H * W):
        model = chainer.Sequential(L.Linear(in_size, OUT),
                                   L.Linear(OUT, 2))
        optimizer = chainerkfac.optimizers.KFAC(
            doubly_factored_from=threshold)
        optimizer.setup(model)
        return [type(b).__name__ for b in optimizer.blocks]

    assert block_types(None) == ['LinearBlock', 'LinearBlock']
    assert block_types(18) == ['DoublyFactoredBlock', 'LinearBlock']
    assert block_types(19) == ['LinearBlock', 'LinearBlock']
    # A lazily initialised link has no width at setup.
    assert block_types(1, in_size=None) == ['LinearBlock',
                                            'DoublyFactoredBlock']
    for bad in (0, -4, 2.5, 'wide', True):
        with pytest.raises(ValueError, match='doubly_factored_from'):
            chainerkfac.optimizers.KFAC(doubly_factored_from=bad)


def test_lazy_link_above_the_width_says_it_keeps_the_standard_block(
        caplog):
    model = chainer.Sequential(L.Linear(None, OUT), F.relu, L.Linear(OUT, 2))
    optimizer = chainerkfac.optimizers.KFAC(doubly_factored_from=18)
    optimizer.setup(model)
    x = numpy.ones((4, C, H, W), dtype=numpy.float32)
    t = numpy.zeros(4, dtype=numpy.int32)
    for _ in range(2):
        with caplog.at_level('WARNING', logger='chainerkfac.fallback'):
            optimizer.update(lambda x, t: F.softmax_cross_entropy(
                model(x), t), x, t)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(
        'KFAC layer 0: its input is 18 wide, at least '
        'doubly_factored_from=18, but the link was initialised lazily')
    assert type(optimizer.blocks[0]).__name__ == 'LinearBlock'


def test_input_that_is_not_the_feature_map_is_refused_by_name():
    numpy.random.seed(0)
    model = Net()
    optimizer = chainerkfac.optimizers.KFAC(doubly_factored_from=18,
                                            factor_interval=1)
    optimizer.setup(model)
    x, t = batch()
    flat = F.relu(model.conv(x)).array.reshape(len(x), -1)
    with pytest.raises(ValueError, match=r'layer fc: .*18 wide.*'
                       r'doubly_factored_from=18.*shape \(10, 18\)'):
        optimizer.update(lambda h, t: F.softmax_cross_entropy(
            model.fc(h), t), flat, t)
    optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                     x, t)
    assert optimizer.blocks[1].layout == (C, H * W)
    other = F.relu(model.conv(x)).array.reshape(len(x), 6, 3)
    with pytest.raises(ValueError, match=r'layer fc: .*3 channels at 6 '
                       r'positions, and now gets shape \(10, 6, 3\)'):
        optimizer.update(lambda h, t: F.softmax_cross_entropy(
            model.fc(h), t), other, t)


def test_cost_counts_three_small_factors():
    numpy.random.seed(0)
    model = Net()
    optimizer = chainerkfac.optimizers.KFAC(doubly_factored_from=18)
    optimizer.setup(model)
    block = optimizer.blocks[1]
    assert 'layout set at first forward' in block.describe()
    assert block.cost().dims == (4, 4, OUT)   # the width's square root
    x, t = batch()
    optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                     x, t)
    cost = block.cost()
    assert cost.kind == 'doubly_factored' and cost.dims == (6, 3, OUT)
    assert cost.inverse_cost == 6 ** 3 + 3 ** 3 + 2 * OUT ** 3
    assert cost.precondition_cost == 2 * 6 * 3 * OUT * (6 + 3 + OUT) + \
        2 * OUT ** 2
    assert not block.splittable()


def trained(optimizer, model, x, t, steps=2):
    optimizer.setup(model)
    for _ in range(steps):
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         x, t)
    return optimizer


def test_factors_under_a_loss_scale_and_with_channels_above_positions():
    # C = 6 > T = 2 (the Gram matrix of the positions); the loss scale is
    # divided out of G only (Ψ and K come from the forward pass).
    class Wide(chainer.Chain):
        def __init__(self):
            super().__init__()
            with chainer.using_config('dtype', numpy.float64), \
                    self.init_scope():
                self.conv = L.Convolution2D(2, 6, 3, pad=1)
                self.fc = L.Linear(12, OUT)

        def forward(self, x):
            return self.fc(F.relu(self.conv(x)))

    x, t = numpy.random.RandomState(3).randn(10, 2, 1, 2), batch()[1]
    factors = []
    for scale in (None, 1024.0):
        numpy.random.seed(0)
        optimizer = chainerkfac.optimizers.KFAC(
            doubly_factored_from=12, factor_interval=1, step_rule='natural',
            kl_clip=None)
        if scale:
            optimizer.loss_scaling(scale=scale)
        trained(optimizer, Wide(), x, t, steps=1)
        block = optimizer.blocks[1]
        assert block.layout == (6, 2)
        factors.append({f: block.factor[f] for f in block.factors})
    for f in ('K', 'Psi', 'G'):
        numpy.testing.assert_allclose(factors[1][f], factors[0][f],
                                      rtol=1e-10, err_msg=f)


@pytest.mark.parametrize('nonfinite', ['raise', 'skip'])
def test_non_finite_input_is_reported_like_the_standard_blocks(nonfinite):
    numpy.random.seed(0)
    model = Net()
    optimizer = trained(chainerkfac.optimizers.KFAC(
        doubly_factored_from=18, factor_interval=1, nonfinite=nonfinite),
        model, *batch())
    before = model.fc.W.array.copy()
    x, t = batch(seed=1)
    x[3] = numpy.nan
    step = lambda: optimizer.update(  # NOQA: E731
        lambda x, t: F.softmax_cross_entropy(model(x), t), x, t)
    if nonfinite == 'raise':
        # (not LAPACK's LinAlgError from inside the forward pass)
        with pytest.raises(chainerkfac.NonFiniteError, match='non-finite'):
            step()
    else:
        step()
        numpy.testing.assert_array_equal(model.fc.W.array, before)


def test_snapshot_fixes_the_layout_and_refuses_another_kind_of_block():
    numpy.random.seed(0)
    optimizer = trained(chainerkfac.optimizers.KFAC(
        doubly_factored_from=18, factor_interval=1), Net(), *batch())
    state = {}
    chainer.serializers.DictionarySerializer(state).save(optimizer)
    # (Its upper triangle: the factor is symmetric.)
    assert state['kfac/fc/Psi'].shape == (C * (C + 1) // 2,)

    def loaded(state, **options):
        numpy.random.seed(0)
        model = Net()
        optimizer = chainerkfac.optimizers.KFAC(**options)
        optimizer.setup(model)
        chainer.serializers.NpzDeserializer(state).load(optimizer)
        return model, optimizer

    model, resumed = loaded(state, doubly_factored_from=18,
                            factor_interval=1)
    assert resumed.blocks[1].layout == (C, H * W)
    x, t = batch()
    other = F.relu(model.conv(x)).array.reshape(len(x), 6, 3)
    with pytest.raises(ValueError, match='3 channels at 6 positions'):
        resumed.update(lambda h, t: F.softmax_cross_entropy(
            model.fc(h), t), other, t)
    # A's block or Ψ's, whichever the snapshot or the run has.
    with pytest.raises(ValueError, match="'fc: doubly-factored K-FAC Psi "
                       "3x3, K 6x6, G 4x4, bias block 4x4' in the snapshot, "
                       "'fc: K-FAC A 19x19, G 4x4' in this model"):
        loaded(state)
    numpy.random.seed(0)
    standard = {}
    chainer.serializers.DictionarySerializer(standard).save(trained(
        chainerkfac.optimizers.KFAC(), Net(), *batch()))
    with pytest.raises(ValueError, match="'fc: K-FAC A 19x19, G 4x4' in "
                       "the snapshot, 'fc: doubly-factored K-FAC \\(input 18 "
                       "wide\\), layout set at first forward"):
        loaded(standard, doubly_factored_from=18)
