"""List files in ``LabeledImageDataset`` format that allow spaces in paths.

A list has one ``path label`` line per image, the path relative to a root
folder. ``LabeledImageDataset(list_path)`` splits each line on every
whitespace and rejects a line with more than two fields, so a path with a
space fails there. We split on the *last* run of whitespace instead and
hand the dataset the ``(path, label)`` pairs rather than the file name.
(Trailing whitespace of a path is lost this way, so :func:`write_list`
refuses such paths, and line breaks.)
"""


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
