#!/usr/bin/env python
"""Prepares a dataset for ``train.py``: resized images, list files, mean.

ImageNet (or any tree of the same shape)::

    python prepare.py imagenet SRC OUT [--size 256] [--val-labels FILE]

reads ``SRC/train/<class>/<image>`` and either ``SRC/val/<class>/<image>``
or a flat ``SRC/val/`` with ``--val-labels`` (lines ``<file> <label>``, the
label a class folder name or an index into the sorted class names).

The digits bundled with scikit-learn (1,797 8x8 images, 10 classes)::

    python prepare.py digits OUT [--size 32] [--val-fraction 0.2]

writes them as an ImageNet-style tree of 8x8 PNG files in a temporary folder
and prepares that tree like ImageNet, so the whole pipeline runs offline.

Either way ``OUT`` receives, with progress bars on stderr:

* ``train/...`` and ``val/...``: every image as RGB, resized to
  ``size`` x ``size`` ignoring its aspect ratio (Osawa et al. §4.1), JPEG;
* ``train.txt``, ``val.txt``: ``path label`` lines, paths relative to
  ``OUT`` (:mod:`image_list`; spaces in paths are fine);
* ``mean.npy``: the per-pixel mean of the resized training images, float32
  (3, size, size);
* ``labels.txt``: the class names, line ``i`` naming label ``i``.
"""
import argparse
import multiprocessing
import os
import sys
import tempfile

import numpy
from PIL import Image

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import image_list

JPEG_QUALITY = 95
#: Images per task of a worker process; small enough for a smooth progress
#: bar, large enough that sending a chunk's pixel sum back is cheap.
CHUNK = 64


class ProgressBar:
    """A one-line text progress bar on stderr."""

    def __init__(self, name, total, width=30):
        self.name = name
        self.total = total
        self.width = width
        self.done = 0
        self.update(0)

    def update(self, n):
        self.done += n
        filled = self.width * self.done // max(self.total, 1)
        sys.stderr.write('\r{} [{}{}] {}/{}'.format(
            self.name, '#' * filled, '.' * (self.width - filled), self.done,
            self.total))
        if self.done >= self.total:
            sys.stderr.write('\n')
        sys.stderr.flush()


def image_files(folder):
    """Relative paths of the files under ``folder``, sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        found += [os.path.relpath(os.path.join(root, name), folder)
                  for name in sorted(files) if not name.startswith('.')]
    return found


def scan_class_tree(folder):
    """``(class names, [(relative path, label)])`` of ``folder/<class>/*``."""
    classes = sorted(name for name in os.listdir(folder)
                     if os.path.isdir(os.path.join(folder, name)))
    pairs = [(os.path.join(name, path), label)
             for label, name in enumerate(classes)
             for path in image_files(os.path.join(folder, name))]
    return classes, pairs


def read_val_labels(path, classes):
    """Pairs from ``<file> <label>`` lines; a label is a class (a folder
    name of ``train/``, an ImageNet ``wnid``) or an index into the sorted
    classes. A line whose label is neither raises ``ValueError`` naming the
    file, the line and the label: the devkit's own class numbers follow
    another order than the sorted folder names, and would silently
    mislabel every image."""
    index = {name: i for i, name in enumerate(classes)}
    pairs = []
    with open(path, encoding='utf-8') as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip('\r\n').rsplit(None, 1)
            label = parts[-1]
            if label in index:
                value = index[label]
            elif label.isdigit() and int(label) < len(classes):
                value = int(label)
            else:
                raise ValueError(
                    '{}, line {}: label {!r} is neither a class of train/ '
                    '(e.g. {}) nor an index below {}'.format(
                        path, number, label, classes[0], len(classes)))
            if len(parts) != 2:
                raise ValueError('{}, line {}: expected "<file> <label>", '
                                 'got {!r}'.format(path, number, line))
            pairs.append((parts[0], value))
    return pairs


def resize_chunk(task):
    """Resizes and writes a chunk of images; returns their count and sum.

    ``task`` is ``(src_root, out_root, [(src_rel, dst_rel)], size,
    with_sum)``; the pixel sum (float64, HWC) is ``None`` unless asked for.
    """
    src_root, out_root, items, size, with_sum = task
    total = numpy.zeros((size, size, 3)) if with_sum else None
    for src, dst in items:
        dst = os.path.join(out_root, dst)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with Image.open(os.path.join(src_root, src)) as image:
            image = image.convert('RGB').resize((size, size), Image.BILINEAR)
        image.save(dst, quality=JPEG_QUALITY)
        if with_sum:
            total += numpy.asarray(image)
    return len(items), total


def convert_split(name, src_root, out_root, pairs, size, jobs, with_sum):
    """Writes the resized images of one split; returns the list pairs and,
    when ``with_sum``, the mean image (3, size, size) float32."""
    dst_pairs = [(os.path.join(name, os.path.splitext(src)[0] + '.JPEG'),
                  label) for src, label in pairs]
    items = [(src, dst) for (src, _), (dst, _) in zip(pairs, dst_pairs)]
    tasks = [(src_root, out_root, items[i:i + CHUNK], size, with_sum)
             for i in range(0, len(items), CHUNK)]
    progress = ProgressBar(name, len(items))
    total = numpy.zeros((size, size, 3))
    with multiprocessing.Pool(jobs) as pool:
        for count, chunk_sum in pool.imap_unordered(resize_chunk, tasks):
            progress.update(count)
            if with_sum:
                total += chunk_sum
    mean = None
    if with_sum:
        mean = (total / max(len(items), 1)).transpose(2, 0, 1)
        mean = mean.astype(numpy.float32)
    return dst_pairs, mean


def prepare_tree(src, out, size, jobs, val_labels=None):
    """Prepares ``src`` (see the module docstring) into ``out``."""
    classes, train = scan_class_tree(os.path.join(src, 'train'))
    val_dir = os.path.join(src, 'val')
    if val_labels is not None:
        val = read_val_labels(val_labels, classes)
    else:
        val_classes, val = scan_class_tree(val_dir)
        if val_classes != classes:
            raise ValueError('{} and {} have different class folders; pass '
                             '--val-labels for a flat validation folder'
                             .format(os.path.join(src, 'train'), val_dir))
    os.makedirs(out, exist_ok=True)
    train_pairs, mean = convert_split(
        'train', os.path.join(src, 'train'), out, train, size, jobs, True)
    val_pairs, _ = convert_split('val', val_dir, out, val, size, jobs, False)
    image_list.write_list(os.path.join(out, 'train.txt'), train_pairs)
    image_list.write_list(os.path.join(out, 'val.txt'), val_pairs)
    numpy.save(os.path.join(out, 'mean.npy'), mean)
    with open(os.path.join(out, 'labels.txt'), 'w', encoding='utf-8') as f:
        f.writelines(name + '\n' for name in classes)


def write_digits_tree(folder, val_fraction, seed):
    """Writes scikit-learn's digits as ``folder/{train,val}/<digit>/*.png``.
    """
    from sklearn.datasets import load_digits
    digits = load_digits()
    # The 8x8 images hold 0..16; stretch them to the 8-bit range.
    images = numpy.rint(digits.images * (255.0 / 16)).astype(numpy.uint8)
    order = numpy.random.default_rng(seed).permutation(len(images))
    n_val = int(round(len(images) * val_fraction))
    for split, indices in (('val', order[:n_val]), ('train', order[n_val:])):
        for i in indices:
            path = os.path.join(folder, split, str(digits.target[i]),
                                '{:04d}.png'.format(i))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Image.fromarray(images[i]).save(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument('--jobs', type=int, default=os.cpu_count(),
                        help='worker processes (default: all cores)')
    commands = parser.add_subparsers(dest='command', required=True)
    imagenet = commands.add_parser('imagenet', parents=[common],
                                   help='an ImageNet-style tree')
    imagenet.add_argument('src', help='folder holding train/ and val/')
    imagenet.add_argument('out', help='output folder')
    imagenet.add_argument('--size', type=int, default=256)
    imagenet.add_argument('--val-labels', help='labels of a flat val/ folder')
    digits = commands.add_parser('digits', parents=[common],
                                 help="scikit-learn's digits")
    digits.add_argument('out', help='output folder')
    digits.add_argument('--size', type=int, default=32)
    digits.add_argument('--val-fraction', type=float, default=0.2)
    digits.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == 'imagenet':
        prepare_tree(args.src, args.out, args.size, args.jobs,
                     args.val_labels)
    else:
        with tempfile.TemporaryDirectory() as raw:
            write_digits_tree(raw, args.val_fraction, args.seed)
            prepare_tree(raw, args.out, args.size, args.jobs)


if __name__ == '__main__':
    main()
