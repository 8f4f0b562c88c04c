"""Weight rescaling: never grows a weight, shrinks it to sqrt(2 d_out)."""
import chainer
import chainer.links as L
import numpy
import pytest

from schemes import WeightRescaling


def norm(array):
    return float(numpy.sqrt(numpy.sum(array.astype(numpy.float64) ** 2)))


def make_model(conv_scale, linear_scale):
    model = chainer.Sequential(
        L.Convolution2D(3, 4, 3), L.BatchNormalization(4), L.Linear(None, 5))
    model[2](numpy.zeros((1, 16), numpy.float32))  # initialise W
    model[0].W.array *= conv_scale
    model[0].b.array[...] = 100
    model[1].gamma.array[...] = 100
    model[2].W.array *= linear_scale
    return model


def rescale(model, lr=0.0):
    """One SGD step with gradients -W (so W grows by 1 + lr), then the hook.
    """
    optimizer = chainer.optimizers.SGD(lr=lr)
    optimizer.setup(model)
    optimizer.add_hook(WeightRescaling())
    for param in model.params():
        param.grad = -param.array
    optimizer.update()


def test_runs_after_the_update():
    """The step makes the weight too large; the hook then shrinks it."""
    model = make_model(0.5, 0.5)
    assert norm(model[0].W.array) < numpy.sqrt(2 * 4)
    rescale(model, lr=100.0)
    assert norm(model[0].W.array) == pytest.approx(numpy.sqrt(2 * 4),
                                                   rel=1e-6)


def test_large_weights_shrink_to_target():
    model = make_model(100.0, 100.0)
    rescale(model)
    assert norm(model[0].W.array) == pytest.approx(numpy.sqrt(2 * 4),
                                                   rel=1e-6)
    assert norm(model[2].W.array) == pytest.approx(numpy.sqrt(2 * 5),
                                                   rel=1e-6)
    # Biases and BatchNormalization are left alone (lr = 0 here).
    assert (model[0].b.array == 100).all()
    assert (model[1].gamma.array == 100).all()


def test_small_weights_never_grow():
    model = make_model(0.01, 0.01)
    before = [model[0].W.array.copy(), model[2].W.array.copy()]
    rescale(model)
    numpy.testing.assert_array_equal(model[0].W.array, before[0])
    numpy.testing.assert_array_equal(model[2].W.array, before[1])


@pytest.mark.parametrize('seed', range(5))
def test_random_norms(seed):
    rng = numpy.random.default_rng(seed)
    model = make_model(*rng.uniform(0.1, 10, size=2))
    links = (model[0], model[2])
    before = [norm(link.W.array) for link in links]
    rescale(model)
    for link, old in zip(links, before):
        target = numpy.sqrt(2 * link.W.shape[0])
        new = norm(link.W.array)
        assert new <= old * (1 + 1e-6)
        assert new == pytest.approx(min(old, target), rel=1e-5)
