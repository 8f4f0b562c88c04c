"""Running mixup and the soft-target loss."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest
from scipy import integrate, stats

from schemes import RunningMixup, SoftTargetClassifier
from schemes import soft_target_cross_entropy


def batch(n, n_classes, rng):
    return [(rng.standard_normal((3, 2, 2)).astype(numpy.float32),
             numpy.int32(rng.integers(n_classes))) for _ in range(n)]


class FixedBeta:
    """Stands in for the generator: ``beta`` returns the given draws."""

    def __init__(self, draws):
        self.draws = list(draws)

    def beta(self, a, b, size):
        return numpy.asarray(self.draws.pop(0), dtype=numpy.float64)


@pytest.mark.parametrize('alpha', [0.4, 1.0])
def test_lambda_statistics(alpha):
    """E[max(λ, 1-λ)] for λ ~ Beta(α, α), and the support [1/2, 1]."""
    lam = RunningMixup(alpha, 10, seed=0).sample_lambda(200000)
    assert lam.min() >= 0.5 and lam.max() <= 1.0
    pdf = stats.beta(alpha, alpha).pdf
    expected = 2 * integrate.quad(lambda v: v * pdf(v), 0.5, 1)[0]
    assert abs(lam.mean() - expected) < 3e-3
    if alpha == 1.0:
        assert expected == pytest.approx(0.75)


def test_running_recursion_matches_hand_computation():
    rng = numpy.random.default_rng(0)
    batches = [batch(2, 3, rng) for _ in range(3)]
    mixup = RunningMixup(0.4, 3)
    # max(λ, 1 - λ) turns the draws 0.2 and 0.9 into 0.8 and 0.9.
    mixup.rng = FixedBeta([[0.2, 0.9], [0.6, 0.7]])
    outputs = [mixup(b) for b in batches]

    xs = [numpy.stack([x for x, _ in b]) for b in batches]
    ys = [numpy.eye(3, dtype=numpy.float32)[[t for _, t in b]]
          for b in batches]
    lam1 = numpy.array([0.8, 0.9], numpy.float32)[:, None]
    lam2 = numpy.array([0.6, 0.7], numpy.float32)[:, None]
    x1, y1 = xs[0], ys[0]  # the first batch is used as it is
    x2 = lam1[..., None, None] * xs[1] + (1 - lam1[..., None, None]) * x1
    y2 = lam1 * ys[1] + (1 - lam1) * y1
    x3 = lam2[..., None, None] * xs[2] + (1 - lam2[..., None, None]) * x2
    y3 = lam2 * ys[2] + (1 - lam2) * y2
    for (x, t, y), ex, ey, b in zip(outputs, (x1, x2, x3), (y1, y2, y3),
                                    batches):
        numpy.testing.assert_allclose(x, ex, rtol=1e-6)
        numpy.testing.assert_allclose(y, ey, rtol=1e-6)
        numpy.testing.assert_array_equal(t, [label for _, label in b])


def test_soft_targets_are_distributions_led_by_the_current_label():
    rng = numpy.random.default_rng(1)
    mixup = RunningMixup(1.0, 5, seed=0)
    for _ in range(20):
        x, t, y = mixup(batch(16, 5, rng))
        numpy.testing.assert_allclose(y.sum(axis=1), 1, rtol=1e-6)
        assert (y >= 0).all()
        assert (y[numpy.arange(16), t] >= 0.5 - 1e-6).all()


def test_batch_shape_change_restarts_the_recursion():
    rng = numpy.random.default_rng(2)
    mixup = RunningMixup(1.0, 4, seed=0)
    mixup(batch(4, 4, rng))
    b = batch(3, 4, rng)
    x, t, y = mixup(b)
    numpy.testing.assert_array_equal(x, numpy.stack([v for v, _ in b]))
    numpy.testing.assert_array_equal(y, numpy.eye(4)[t])


def test_state_survives_serialization(tmp_path):
    rng = numpy.random.default_rng(3)
    batches = [batch(4, 3, rng) for _ in range(2)]
    mixup = RunningMixup(1.0, 3, seed=0)
    mixup(batches[0])
    path = str(tmp_path / 'mixup.npz')
    chainer.serializers.save_npz(path, mixup)
    restored = RunningMixup(1.0, 3, seed=0)
    chainer.serializers.load_npz(path, restored)
    mixup.rng = numpy.random.default_rng(7)
    restored.rng = numpy.random.default_rng(7)
    for a, b in zip(mixup(batches[1]), restored(batches[1])):
        numpy.testing.assert_array_equal(a, b)


def test_empty_state_serializes(tmp_path):
    path = str(tmp_path / 'mixup.npz')
    chainer.serializers.save_npz(path, RunningMixup(1.0, 3))
    restored = RunningMixup(1.0, 3)
    chainer.serializers.load_npz(path, restored)
    assert restored.previous is None


def test_soft_cross_entropy_equals_hard_for_one_hot():
    rng = numpy.random.default_rng(4)
    z = rng.standard_normal((6, 4)).astype(numpy.float32)
    t = rng.integers(4, size=6).astype(numpy.int32)
    y = numpy.eye(4, dtype=numpy.float32)[t]
    numpy.testing.assert_allclose(
        soft_target_cross_entropy(z, y).array,
        F.softmax_cross_entropy(z, t).array, rtol=1e-6)


def test_soft_cross_entropy_value():
    z = numpy.log(numpy.array([[0.5, 0.25, 0.25]], numpy.float32))
    y = numpy.array([[0.6, 0.4, 0.0]], numpy.float32)
    expected = -(0.6 * numpy.log(0.5) + 0.4 * numpy.log(0.25))
    assert float(soft_target_cross_entropy(z, y).array) == pytest.approx(
        expected, rel=1e-6)


def test_classifier_reports_the_loss_it_returns():
    model = SoftTargetClassifier(L.Linear(4, 3))
    rng = numpy.random.default_rng(5)
    x = rng.standard_normal((5, 4)).astype(numpy.float32)
    t = numpy.array([0, 1, 2, 0, 1], numpy.int32)
    y = numpy.full((5, 3), 1 / 3, numpy.float32)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    for args in ((x, t), (x, t, y)):
        observation = {}
        with reporter.scope(observation):
            loss = model(*args)
        assert float(observation['main/loss'].array) == float(loss.array)
        z = model.predictor(x).array
        assert float(observation['main/accuracy'].array) == pytest.approx(
            numpy.mean(z.argmax(axis=1) == t))
    # With uniform soft targets the loss is the mean log-sum-exp minus
    # the mean score, not the hard-label cross entropy.
    expected = numpy.mean(numpy.log(numpy.exp(z).sum(axis=1))
                          - z.mean(axis=1))
    assert float(loss.array) == pytest.approx(expected, rel=1e-5)
