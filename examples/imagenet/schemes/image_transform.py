"""Data augmentation of Osawa et al. §4.1, as TransformDataset transforms.

Images are pre-resized to ``image_size`` x ``image_size`` ignoring their
aspect ratio (``prepare.py``); an image of another size is resized the same
way when it is read. Then, for training::

    x = (flip(crop(image)) - mean[:, :c, :c]) * scale,   c = crop_size

with a random ``c`` x ``c`` crop and a random horizontal flip, followed by
random erasing with zeros. The subtracted mean is the upper-left ``c`` x
``c`` corner of the per-pixel mean image whatever the crop position, as the
paper describes it. ``scale = 1/255``
brings pixels to roughly [-1, 1]. Validation uses the center crop and
neither flip nor erasing.

Both transforms map ``(image, label)`` from ``LabeledImageDataset`` (a
float32 CHW array with 0..255 values) to ``(x, label)``.
"""
import os

import numpy
from PIL import Image


def fit_image(image, image_size):
    """Returns ``image`` as 3 channels of ``image_size`` x ``image_size``.

    Grey images are repeated to RGB and an alpha channel is dropped, since
    ImageNet holds a few of both. Resizing goes through PIL on 8-bit values,
    which is exact because the dataset read the image from 8-bit pixels.
    """
    if image.shape[0] == 1:
        image = numpy.repeat(image, 3, axis=0)
    image = image[:3]
    if image.shape[1:] != (image_size, image_size):
        pil = Image.fromarray(image.transpose(1, 2, 0).astype(numpy.uint8))
        pil = pil.resize((image_size, image_size), Image.BILINEAR)
        image = numpy.asarray(pil, dtype=numpy.float32).transpose(2, 0, 1)
    return image


class ValTransform:
    """Center crop, mean subtraction and scaling.

    Args:
        crop_size (int): Side ``c`` of the crop.
        image_size (int): Side of the pre-resized images.
        mean (numpy.ndarray or None): Per-pixel mean image (3, S, S) with
            ``S >= crop_size``; ``None`` subtracts nothing.
        scale (float): Factor applied after the mean subtraction.
    """

    def __init__(self, crop_size, image_size, mean=None, scale=1.0 / 255):
        if crop_size > image_size:
            raise ValueError('crop_size {} exceeds image_size {}'
                             .format(crop_size, image_size))
        self.crop_size = crop_size
        self.image_size = image_size
        self.mean = (None if mean is None else numpy.asarray(
            mean[:, :crop_size, :crop_size], dtype=numpy.float32))
        self.scale = scale

    def crop(self, image):
        top = left = (self.image_size - self.crop_size) // 2
        return image[:, top:top + self.crop_size, left:left + self.crop_size]

    def normalize(self, image):
        image = numpy.array(image, dtype=numpy.float32)
        if self.mean is not None:
            image -= self.mean
        image *= self.scale
        return image

    def __call__(self, in_data):
        image, label = in_data
        image = fit_image(image, self.image_size)
        return self.normalize(self.crop(image)), label


class TrainTransform(ValTransform):
    """Random (or center) crop, flip, mean subtraction, scaling, erasing.

    Args:
        crop_size, image_size, mean, scale: As :class:`ValTransform`.
        random_crop (bool): Crop at a random position instead of the center.
        flip (bool): Flip horizontally with probability 1/2.
        erasing (RandomErasing or None): Applied last, to the scaled image.
        seed (int or None): Seed of the process that builds the transform.
            Worker processes forked by ``MultiprocessIterator`` would all
            inherit the same generator state, so each of them draws a fresh
            OS-entropy seed on its first use instead.
    """

    def __init__(self, crop_size, image_size, mean=None, scale=1.0 / 255,
                 random_crop=True, flip=True, erasing=None, seed=None):
        super().__init__(crop_size, image_size, mean, scale)
        self.random_crop = random_crop
        self.flip = flip
        self.erasing = erasing
        self._pid = os.getpid()
        self._rng = numpy.random.default_rng(seed)

    @property
    def rng(self):
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._rng = numpy.random.default_rng()
        return self._rng

    def crop(self, image):
        if not self.random_crop:
            return super().crop(image)
        top, left = self.rng.integers(
            0, self.image_size - self.crop_size + 1, size=2)
        return image[:, top:top + self.crop_size, left:left + self.crop_size]

    def __call__(self, in_data):
        image, label = in_data
        image = self.crop(fit_image(image, self.image_size))
        if self.flip and self.rng.random() < 0.5:
            image = image[:, :, ::-1]
        image = self.normalize(image)
        if self.erasing is not None:
            self.erasing(image, self.rng)
        return image, label
