"""Dataset transforms: crop, flip, mean, scaling, resizing, random erasing."""
import numpy
import pytest

from schemes import RandomErasing, TrainTransform, ValTransform


def ramp_image(size):
    """An image whose pixel (c, h, w) holds 100 c + 10 h + w (distinct)."""
    c, h, w = numpy.meshgrid(numpy.arange(3), numpy.arange(size),
                             numpy.arange(size), indexing='ij')
    return (100 * c + 10 * h + w).astype(numpy.float32)


def test_val_transform_center_crop_mean_and_scale():
    image = ramp_image(8)
    mean = numpy.full((3, 8, 8), 5, numpy.float32)
    mean[:, 0, 0] = 1  # the top-left corner is what is subtracted
    x, label = ValTransform(4, 8, mean, scale=0.5)((image, 3))
    assert label == 3 and x.dtype == numpy.float32 and x.shape == (3, 4, 4)
    expected = (image[:, 2:6, 2:6] - mean[:, :4, :4]) * 0.5
    numpy.testing.assert_allclose(x, expected)


def test_train_transform_crop_is_a_window_of_the_image():
    image = ramp_image(8)
    transform = TrainTransform(4, 8, flip=False, scale=1.0, seed=0)
    positions = set()
    for _ in range(200):
        x, _ = transform((image, 0))
        top, left = int(x[0, 0, 0]) // 10, int(x[0, 0, 0]) % 10
        numpy.testing.assert_array_equal(
            x, image[:, top:top + 4, left:left + 4])
        positions.add((top, left))
    assert positions == {(t, c) for t in range(5) for c in range(5)}


def test_train_transform_flip_half_of_the_time():
    image = ramp_image(4)
    transform = TrainTransform(4, 4, scale=1.0, seed=0)
    flips = 0
    for _ in range(400):
        x, _ = transform((image, 0))
        if numpy.array_equal(x, image[:, :, ::-1]):
            flips += 1
        else:
            numpy.testing.assert_array_equal(x, image)
    assert 160 < flips < 240


def test_switches_off():
    image = ramp_image(8)
    transform = TrainTransform(4, 8, scale=1.0, random_crop=False,
                               flip=False)
    x, _ = transform((image, 0))
    numpy.testing.assert_array_equal(x, image[:, 2:6, 2:6])


def test_resizes_on_the_fly_and_converts_grey():
    grey = numpy.full((1, 20, 30), 200, numpy.float32)
    x, _ = ValTransform(8, 10, scale=1.0)((grey, 0))
    assert x.shape == (3, 8, 8)
    numpy.testing.assert_allclose(x, 200)


def test_crop_larger_than_image_is_refused():
    with pytest.raises(ValueError, match='crop_size'):
        ValTransform(10, 8)


def test_erasing_region_bounds():
    erasing = RandomErasing(1.0, (0.02, 0.25), 0.3)
    rng = numpy.random.default_rng(0)
    size = 100
    tall = 0
    for _ in range(2000):
        top, left, h, w = erasing.sample_region(size, size, rng)
        assert 0 <= top and top + h <= size and 0 <= left and left + w <= size
        # Rounding each side to whole pixels moves the area by < h + w.
        area = h * w / size ** 2
        assert 0.02 - (h + w) / size ** 2 <= area <= 0.25 + (h + w) / size ** 2
        aspect = min(h, w) / max(h, w)
        assert 0.3 * 0.95 <= aspect <= 1
        tall += h > w
    assert 800 < tall < 1200  # h and w are swapped half of the time


def test_erasing_writes_zeros_only_inside_one_rectangle():
    erasing = RandomErasing(1.0, (0.02, 0.25), 0.3)
    rng = numpy.random.default_rng(1)
    for _ in range(100):
        image = numpy.ones((3, 32, 32), numpy.float32)
        erasing(image, rng)
        zero = image == 0
        assert (zero == zero[0]).all()  # all channels alike
        rows = numpy.flatnonzero(zero[0].any(axis=1))
        cols = numpy.flatnonzero(zero[0].any(axis=0))
        # The zeros fill exactly the bounding box of the zeros.
        box = numpy.zeros_like(zero[0])
        box[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1] = True
        numpy.testing.assert_array_equal(zero[0], box)
        assert (image[~zero] == 1).all()


def test_erasing_probability():
    erasing = RandomErasing(0.5)
    rng = numpy.random.default_rng(2)
    erased = sum(erasing.sample_region(32, 32, rng) is not None
                 for _ in range(1000))
    assert 430 < erased < 570
    assert RandomErasing(0.0).sample_region(32, 32, rng) is None


def test_train_transform_erases_after_scaling():
    image = numpy.full((3, 8, 8), 100, numpy.float32)
    transform = TrainTransform(
        8, 8, scale=1.0, erasing=RandomErasing(1.0), seed=0)
    x, _ = transform((image, 0))
    assert set(numpy.unique(x)) == {0.0, 100.0}
