"""Random erasing with zero value (Zhong et al. 2017; Osawa et al. §4.1).

With probability ``p`` a rectangle of the image is set to 0. Its area is a
fraction ``s ~ U(s_l, s_h)`` of the image and its aspect ratio
``r ~ U(r_l, 1)``::

    h_e = round(sqrt(s H W r)),  w_e = round(sqrt(s H W / r)),

then ``h_e`` and ``w_e`` are swapped with probability 1/2 (so tall and wide
regions are equally likely), clipped to the image, and the rectangle is
placed uniformly at random inside it. The paper uses ``p = 0.5``,
``s ~ U(0.02, 0.25)``, ``r ~ U(0.3, 1)``, and fills with zeros instead of
the original method's random values (after mean subtraction zero is the
mean input, our reading; the paper gives no reason).
"""
import math


class RandomErasing:
    """Erases one random rectangle of a CHW image in place.

    Args:
        probability (float): Chance ``p`` that an image is erased.
        area_range (tuple of float): ``(s_l, s_h)``, the area fraction range.
        aspect_min (float): ``r_l``; the aspect ratio is drawn from
            ``U(r_l, 1)``.
    """

    def __init__(self, probability=0.5, area_range=(0.02, 0.25),
                 aspect_min=0.3):
        self.probability = probability
        self.area_range = tuple(area_range)
        self.aspect_min = aspect_min

    def sample_region(self, height, width, rng):
        """Draws the rectangle ``(top, left, h_e, w_e)`` or ``None``.

        Args:
            height, width (int): Image size.
            rng (numpy.random.Generator): Source of randomness.
        """
        if rng.random() >= self.probability:
            return None
        area = height * width * rng.uniform(*self.area_range)
        aspect = rng.uniform(self.aspect_min, 1.0)
        h_e = int(round(math.sqrt(area * aspect)))
        w_e = int(round(math.sqrt(area / aspect)))
        if rng.random() < 0.5:
            h_e, w_e = w_e, h_e
        h_e, w_e = min(h_e, height), min(w_e, width)
        top = int(rng.integers(0, height - h_e + 1))
        left = int(rng.integers(0, width - w_e + 1))
        return top, left, h_e, w_e

    def __call__(self, image, rng):
        """Erases a region of ``image`` (C, H, W) in place and returns it."""
        region = self.sample_region(image.shape[1], image.shape[2], rng)
        if region is not None:
            top, left, h_e, w_e = region
            image[:, top:top + h_e, left:left + w_e] = 0
        return image
