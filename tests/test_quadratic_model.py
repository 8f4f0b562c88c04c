"""step_rule='adaptive': α, μ and λ from the quadratic model, against the
model built from explicit Jacobians (Martens & Grosse 2015 §6-7)."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac.optimizers import quadratic_model
from tests import mpi_helpers
from tests import snapshot_helpers


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with chainer.using_config('dtype', numpy.float64), self.init_scope():
            self.l1 = L.Linear(4, 5)
            self.l2 = L.Linear(5, 3)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def batch(seed, n=16):
    rng = numpy.random.RandomState(seed)
    x = rng.randn(n, 4)
    return x, (x[:, 0] > 0).astype(numpy.int32) + (x[:, 1] > 0)


def flat(arrays):
    return numpy.concatenate([numpy.asarray(a).ravel() for a in arrays])


def gradient_and_gauss_newton(model, x, t):
    """``∇h`` and the explicit ``G = (1/n) Σ J_iᵀ (diag p − p pᵀ) J_i`` at
    ``model``'s parameters (on a copy without K-FAC's link hooks, which
    would collect the statistics of every backward here)."""
    classifier = L.Classifier(MLP())
    classifier.copyparams(model)
    params = list(classifier.params())
    classifier.cleargrads()
    classifier(x, t).backward()
    grad = flat([p.grad for p in params])
    n = len(x)
    logits = classifier.predictor(x)
    p = F.softmax(logits).array
    G = numpy.zeros((len(grad), len(grad)))
    for i in range(n):
        rows = []
        for k in range(logits.shape[1]):
            classifier.cleargrads()
            logits[i, k].backward(retain_grad=True)
            rows.append(flat([q.grad for q in params]))
            logits = classifier.predictor(x)
        J = numpy.array(rows)
        H = numpy.diag(p[i]) - numpy.outer(p[i], p[i])
        G += J.T @ H @ J / n
    classifier.cleargrads()
    return grad, G


def snapshot(model):
    return flat([p.array for p in model.params()])


def test_solve_minimises_the_model():
    rng = numpy.random.RandomState(0)
    a = rng.randn(2, 2)
    curvature, euclidean = a @ a.T, numpy.array([[2.0, 0.3], [0.3, 1.0]])
    linear = rng.randn(2)
    x, change = quadratic_model.solve(curvature, euclidean, linear, 0.1)
    system = curvature + 0.1 * euclidean
    numpy.testing.assert_allclose(system @ x, -linear, atol=1e-12)
    assert change == pytest.approx(linear @ x + 0.5 * x @ system @ x)
    # No previous update: μ stays 0, α alone.
    x, _ = quadratic_model.solve(numpy.diag([3.0, 0.0]),
                                 numpy.diag([1.0, 0.0]), [-2.0, 0.0], 1.0)
    numpy.testing.assert_allclose(x, [0.5, 0.0])


def test_gauss_newton_gram_is_the_softmax_hessian_products():
    rng = numpy.random.RandomState(1)
    logits, changes = rng.randn(6, 4), [rng.randn(6, 4) for _ in range(2)]
    p = numpy.exp(logits) / numpy.exp(logits).sum(axis=1, keepdims=True)
    expected = numpy.zeros((2, 2))
    for i in range(6):
        H = numpy.diag(p[i]) - numpy.outer(p[i], p[i])
        for a in range(2):
            for b in range(2):
                expected[a, b] += changes[a][i] @ H @ changes[b][i] / 6
    numpy.testing.assert_allclose(
        quadratic_model.gauss_newton_gram(logits, changes), expected,
        rtol=1e-12)


def test_first_step_is_the_model_optimal_natural_step():
    # The natural step of a twin (lr 1, no momentum, no guard) from the
    # same state is V; the adaptive step is α (−V) with
    # α = −∇hᵀΔ / (ΔᵀGΔ + λ‖Δ‖²) under the explicit G.
    x, t = batch(0)
    steps = {}
    for name, options in (
            ('natural', dict(lr=1.0, momentum=0.0, step_rule='natural',
                             kl_clip=None)),
            ('adaptive', dict(step_rule='adaptive'))):
        numpy.random.seed(0)
        model = L.Classifier(MLP())
        optimizer = chainerkfac.optimizers.KFAC(damping=1e-2, **options)
        optimizer.setup(model)
        before = snapshot(model)
        if name == 'adaptive':
            grad, G = gradient_and_gauss_newton(model, x, t)
        optimizer.update(model, x, t)
        steps[name] = snapshot(model) - before
    direction = steps['natural']
    alpha = -(grad @ direction) / (direction @ G @ direction
                                   + 1e-2 * direction @ direction)
    numpy.testing.assert_allclose(steps['adaptive'], alpha * direction,
                                  rtol=1e-5)


def test_momentum_is_the_model_optimal_pair():
    # Without preconditioning Δ = −∇h; the second step is αΔ + μv, (α, μ)
    # solving the 2x2 system under the explicit G.
    numpy.random.seed(0)
    model = L.Classifier(MLP())
    optimizer = chainerkfac.optimizers.KFAC(
        step_rule='adaptive', precondition=False, damping=0.1)
    optimizer.setup(model)
    x, t = batch(0)
    start = snapshot(model)
    optimizer.update(model, x, t)
    v = snapshot(model) - start
    x, t = batch(1)
    grad, G = gradient_and_gauss_newton(model, x, t)
    before = snapshot(model)
    optimizer.update(model, x, t)
    delta = -grad
    vectors = numpy.array([delta, v])
    system = vectors @ G @ vectors.T + 0.1 * vectors @ vectors.T
    alpha, mu = -numpy.linalg.solve(system, vectors @ grad)
    assert mu != 0
    numpy.testing.assert_allclose(snapshot(model) - before,
                                  alpha * delta + mu * v, rtol=1e-5,
                                  atol=1e-12)


def test_levenberg_marquardt_moves_the_damping():
    lm = quadratic_model.LevenbergMarquardt(1.0, interval=5)
    omega = (19 / 20) ** 5
    lm.adapt(0.9)
    assert lm.damping == pytest.approx(omega)
    lm.adapt(0.5)
    assert lm.damping == pytest.approx(omega)
    lm.adapt(0.1)
    lm.adapt(float('nan'))
    assert lm.damping == pytest.approx(1 / omega)
    assert [lm.due(s) for s in range(1, 11)] == [False] * 4 + [True] + \
        [False] * 4 + [True]


def test_damping_follows_the_reduction_ratio_and_resumes():
    # Every 5 steps ρ moves λ, which is the inverses' damping; a snapshot
    # keeps it and the resumed run takes the same steps.
    def fresh():
        model = L.Classifier(MLP())
        optimizer = chainerkfac.optimizers.KFAC(step_rule='adaptive',
                                                damping=1e-2)
        optimizer.setup(model)
        return model, optimizer

    def run(resume_at=None):
        numpy.random.seed(0)
        model, optimizer = fresh()
        dampings = []
        for step in range(12):
            if step == resume_at:
                model, optimizer = snapshot_helpers.reloaded(
                    model, optimizer, fresh)
            optimizer.update(model, *batch(step))
            dampings.append(optimizer.damping)
        return dampings, snapshot(model)

    dampings, weights = run()
    assert dampings[0] == 1e-2 and len(set(dampings)) == 3, dampings
    resumed, resumed_weights = run(resume_at=7)
    assert resumed == dampings
    numpy.testing.assert_array_equal(resumed_weights, weights)


def test_what_the_model_cannot_serve_is_refused_by_name():
    numpy.random.seed(0)
    model = L.Classifier(MLP())
    x, t = batch(0)
    optimizer = chainerkfac.optimizers.KFAC(step_rule='adaptive')
    optimizer.setup(model)
    with pytest.raises(ValueError, match='Classifier of softmax_cross'):
        optimizer.update(lambda x, t: F.softmax_cross_entropy(
            model.predictor(x), t), x, t)
    with pytest.raises(ValueError, match='acc_iters=1, got 2'):
        optimizer = chainerkfac.optimizers.KFAC(step_rule='adaptive',
                                                acc_iters=2)
        optimizer.setup(model)
        optimizer.update(model, x, t)


def test_distributed_run_is_refused_by_name():
    result = mpi_helpers.run_mpi(2, '''
import chainer.links as L
import numpy
import chainerkfac
from tests.test_quadratic_model import MLP, batch
model = L.Classifier(MLP())
optimizer = chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(step_rule='adaptive'),
    chainerkfac.create_communicator('naive'))
optimizer.setup(model)
optimizer.update(model, *batch(0))
''', timeout=60)
    assert result.returncode != 0
    assert "step_rule='adaptive' runs in one process only" in result.stderr
