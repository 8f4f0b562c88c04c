"""The models of the ImageNet example: shapes, sizes and link types."""
import chainer
import chainer.links as L
import numpy
import pytest

import models

N_CLASSES = 7


@pytest.fixture(scope='module', params=sorted(models.MODELS))
def model(request):
    """Each model, built once (ResNet-50 takes a second to initialise)."""
    return request.param, models.MODELS[request.param](n_classes=N_CLASSES)


def leaf_links(model):
    return [link for link in model.links()
            if not isinstance(link, (chainer.Chain, chainer.ChainList))]


def test_forward_shape(model):
    name, model = model
    sizes = (32, 64) if name == 'resnet_small' else (32,)
    for size in sizes:
        with chainer.using_config('train', False):
            y = model(numpy.zeros((2, 3, size, size), numpy.float32))
        assert y.shape == (2, N_CLASSES)


def test_parameter_count(model):
    name, model = model
    # torchvision's resnet50 has 25,557,032 parameters with 1000 classes;
    # the deep stem of ResNet-50-D has 28,768 where the 7x7 stem has 9,536.
    expected = {'resnet50': 25557032, 'resnet50d': 25557032 + 19232}
    if name in expected:
        fc_difference = (1000 - N_CLASSES) * (2048 + 1)
        assert sum(p.size for p in model.params()) == \
            expected[name] - fc_difference


def test_only_links_kfac_supports(model):
    """K-FAC has a Fisher block for each parameterised link of the models."""
    kinds = {type(link) for link in leaf_links(model[1])}
    assert kinds == {L.Convolution2D, L.BatchNormalization, L.Linear}


def test_convolutions_have_no_bias_and_he_scale(model):
    convs = [link for link in leaf_links(model[1])
             if isinstance(link, L.Convolution2D)]
    assert all(conv.b is None for conv in convs)
    # He-normal: E ||W||^2 = 2 d_out, the norm weight rescaling targets.
    ratios = [float(numpy.sum(c.W.array ** 2)) / (2 * c.W.shape[0])
              for c in convs]
    assert 0.8 < numpy.mean(ratios) < 1.2
