"""List files and ``prepare.py``."""
import os

import chainer
import numpy
import pytest
from PIL import Image

import image_list
import prepare
from schemes import ValTransform


def test_parse_line_splits_on_the_last_space():
    assert image_list.parse_line('a b/c d.jpg 3\n') == ('a b/c d.jpg', 3)
    assert image_list.parse_line('x.jpg\t12\r\n') == ('x.jpg', 12)
    with pytest.raises(ValueError):
        image_list.parse_line('no-label.jpg\n')


def test_list_round_trip(tmp_path):
    pairs = [('dir with space/img 1.jpg', 3), ('plain.jpg', 0)]
    path = str(tmp_path / 'list.txt')
    image_list.write_list(path, pairs)
    assert image_list.read_list(path) == pairs


def test_unlistable_paths_are_refused(tmp_path):
    for bad in ('trailing.jpg ', 'line\nbreak.jpg'):
        with pytest.raises(ValueError):
            image_list.write_list(str(tmp_path / 'list.txt'), [(bad, 0)])


def test_bad_line_is_located(tmp_path):
    path = tmp_path / 'list.txt'
    path.write_text('a.jpg 1\nb.jpg x\n')
    with pytest.raises(ValueError, match='list.txt:2'):
        image_list.read_list(str(path))


def test_path_with_space_loads(tmp_path):
    folder = tmp_path / 'dir with space'
    folder.mkdir()
    pixels = numpy.full((6, 6, 3), 40, numpy.uint8)
    Image.fromarray(pixels).save(str(folder / 'img 1.png'))
    path = str(tmp_path / 'list.txt')
    image_list.write_list(path, [('dir with space/img 1.png', 2)])
    with pytest.raises(ValueError):  # why read_list exists
        chainer.datasets.LabeledImageDataset(path, str(tmp_path))
    dataset = chainer.datasets.TransformDataset(
        chainer.datasets.LabeledImageDataset(
            image_list.read_list(path), str(tmp_path)),
        ValTransform(4, 6, scale=1.0))
    x, label = dataset[0]
    assert label == 2 and x.shape == (3, 4, 4)
    numpy.testing.assert_allclose(x, 40)


def test_prepare_digits(digits):
    train = image_list.read_list(str(digits / 'train.txt'))
    val = image_list.read_list(str(digits / 'val.txt'))
    assert len(train) + len(val) == 1797
    assert len(val) == round(1797 * 0.2)
    assert {label for _, label in train} == set(range(10))
    labels = (digits / 'labels.txt').read_text().split()
    assert labels == [str(d) for d in range(10)]
    for path, label in train[::200] + val[::100]:
        assert path.split('/')[1] == str(label)
        with Image.open(str(digits / path)) as image:
            assert image.format == 'JPEG'
            assert image.size == (32, 32) and image.mode == 'RGB'
    mean = numpy.load(str(digits / 'mean.npy'))
    assert mean.shape == (3, 32, 32) and mean.dtype == numpy.float32
    # Digits are white on black and centred: the mean is brighter inside.
    assert mean[:, 12:20, 12:20].mean() > 4 * mean[:, :3, :3].mean()
    dataset = chainer.datasets.LabeledImageDataset(train, str(digits))
    image, label = dataset[0]
    assert image.shape == (3, 32, 32)


def test_prepare_tree_with_val_labels(tmp_path):
    """A flat val/ folder with a labels file; sizes other than 256."""
    src = tmp_path / 'src'
    for wnid in ('n01', 'n02'):
        (src / 'train' / wnid).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(numpy.full((5, 7), 50 * i, numpy.uint8)).save(
                str(src / 'train' / wnid / 'im {}.JPEG'.format(i)))
    (src / 'val').mkdir()
    for i in range(2):
        Image.fromarray(numpy.zeros((9, 4, 3), numpy.uint8)).save(
            str(src / 'val' / 'v{}.JPEG'.format(i)))
    labels = tmp_path / 'val_labels.txt'
    labels.write_text('v0.JPEG n02\nv1.JPEG 0\n')
    out = tmp_path / 'out'
    prepare.main(['imagenet', str(src), str(out), '--size', '8',
                  '--val-labels', str(labels), '--jobs', '1'])
    assert image_list.read_list(str(out / 'val.txt')) == [
        ('val/v0.JPEG', 1), ('val/v1.JPEG', 0)]
    train = image_list.read_list(str(out / 'train.txt'))
    assert train[0] == ('train/n01/im 0.JPEG', 0) and len(train) == 6
    mean = numpy.load(str(out / 'mean.npy'))
    assert mean.shape == (3, 8, 8)
    numpy.testing.assert_allclose(mean, 50, atol=2)  # (0 + 50 + 100) / 3
    assert os.path.exists(str(out / 'train' / 'n02' / 'im 2.JPEG'))


@pytest.mark.parametrize('line,label', [('v0.JPEG 490', "'490'"),
                                        ('v0.JPEG n03', "'n03'"),
                                        ('v0.JPEG', "'v0.JPEG'")])
def test_val_labels_of_other_classes_are_refused(tmp_path, line, label):
    # The devkit numbers classes 1-1000 in its own order: such a file must
    # not label the images silently.
    labels = tmp_path / 'val_labels.txt'
    labels.write_text('v1.JPEG n01\n' + line + '\n')
    with pytest.raises(ValueError, match="line 2: label {} is neither a "
                       "class of train/ \\(e.g. n01\\) nor an index below "
                       "2".format(label)):
        prepare.read_val_labels(str(labels), ['n01', 'n02'])
