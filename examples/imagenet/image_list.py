"""List files in ``LabeledImageDataset`` format that allow spaces in paths.

A list has one ``path label`` line per image, the path relative to a root
folder. ``LabeledImageDataset(list_path)`` splits each line on every
whitespace and rejects a line with more than two fields, so a path with a
space fails there. We split on the *last* run of whitespace instead and
hand the dataset the ``(path, label)`` pairs rather than the file name.
(Trailing whitespace of a path is lost this way, so :func:`write_list`
refuses such paths, and line breaks.)

:class:`LabeledImages` reads the images of such pairs, and
:class:`ReadableBatches` names the file when one could not be read.
"""
import os

import chainer


def parse_line(line):
    """``'a b/c.jpg 3\\n'`` -> ``('a b/c.jpg', 3)``."""
    fields = line.rstrip('\r\n').rsplit(None, 1)
    if len(fields) != 2:
        raise ValueError('expected "path label", got {!r}'.format(line))
    return fields[0], int(fields[1])


def read_list(path):
    """Reads a list file into ``[(path, label), ...]`` (blank lines skipped).
    """
    pairs = []
    with open(path, encoding='utf-8') as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                pairs.append(parse_line(line))
            except ValueError as e:
                raise ValueError('{}:{}: {}'.format(path, number, e)) from None
    return pairs


def write_list(path, pairs):
    """Writes ``[(path, label), ...]`` so that :func:`read_list` reads it.
    """
    with open(path, 'w', encoding='utf-8') as f:
        for image_path, label in pairs:
            if (image_path != image_path.rstrip()
                    or '\n' in image_path or '\r' in image_path):
                raise ValueError('a path ending in whitespace or holding a '
                                 'line break cannot be listed: {!r}'
                                 .format(image_path))
            f.write('{} {:d}\n'.format(image_path, label))


class Unreadable:
    """Stands in a batch for an image that could not be read or
    transformed; :class:`ReadableBatches` raises on it."""

    def __init__(self, path, list_name, error):
        self.message = 'cannot read image {} (listed in {}): {}: {}'.format(
            path, list_name, type(error).__name__, error)


class LabeledImages(chainer.dataset.DatasetMixin):
    """``(transform(image), label)`` of ``(path, label)`` pairs under
    ``root``, read by ``LabeledImageDataset``.

    A corrupt, truncated or missing image gives an :class:`Unreadable`
    instead of an exception: an exception in a loader process of
    ``MultiprocessIterator`` stops its prefetch thread and leaves the
    training process waiting for ever, where the batch converter
    (:class:`ReadableBatches`) raises in the training process and ends
    the job, naming the file.
    """

    def __init__(self, pairs, root, transform, list_name='the list'):
        self.images = chainer.datasets.LabeledImageDataset(pairs, root)
        self.paths = [os.path.join(root, path) for path, _ in pairs]
        self.transform = transform
        self.list_name = list_name

    def __len__(self):
        return len(self.images)

    def get_example(self, i):
        try:
            return self.transform(self.images[i])
        except Exception as e:
            return Unreadable(self.paths[i], self.list_name, e)


class ReadableBatches(chainer.dataset.Converter):
    """Converts a batch with ``converter`` after checking that every image
    was read; raises ``IOError('cannot read image PATH (listed in LIST):
    ...')`` otherwise."""

    def __init__(self, converter):
        self.converter = converter

    def __call__(self, batch, device=None):
        for example in batch:
            if isinstance(example, Unreadable):
                raise IOError(example.message)
        return self.converter(batch, device)
