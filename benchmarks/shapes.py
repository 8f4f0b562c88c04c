"""A generated colour image task: ten shapes in clutter, 24x24 RGB.

Each image shows one shape of the ten classes (disk, square, triangle,
ring, cross, bar, diamond, L, two dots, hollow square) at a random position,
size (radius 3.5 to 7 pixels) and rotation (up to ±35°, so that a bar stays
a bar and a square a square), in a random colour, over a background of a
random colour with a smooth random texture, plus a distractor blob of yet
another colour that may cover part of the shape, and pixel noise. The
classes are balanced. Everything derives from the seed: the same call gives
the same arrays on every machine, and nothing is downloaded.

The size (``n_train`` 20,000, ``n_val`` 5,000 by default) and the clutter
make a small ResNet with BatchNorm keep improving for tens of epochs of
MomentumSGD, which is what a comparison of optimizers over epochs needs
(``benchmarks/compare_shapes.py``).
"""
import numpy

#: Image side in pixels.
SIZE = 24
#: Class names, in label order.
CLASSES = ('disk', 'square', 'triangle', 'ring', 'cross', 'bar', 'diamond',
           'L', 'two dots', 'hollow square')


def _masks(u, v):
    """Masks of the ten shapes in the shape's own frame (unit radius)."""
    r = numpy.hypot(u, v)
    au, av = numpy.abs(u), numpy.abs(v)
    box = numpy.maximum(au, av)
    return (
        r < 0.95,
        box < 0.8,
        (v > -0.65) & (au < 0.55 * (1.0 - v)) & (v < 1.0),
        (r < 1.0) & (r > 0.6),
        ((au < 0.3) & (av < 1.0)) | ((av < 0.3) & (au < 1.0)),
        (au < 1.0) & (av < 0.32),
        au + av < 1.05,
        ((u > -0.8) & (u < -0.3) & (av < 0.9))
        | ((v > 0.4) & (v < 0.9) & (u > -0.8) & (u < 0.8)),
        (numpy.hypot(u - 0.55, v) < 0.4) | (numpy.hypot(u + 0.55, v) < 0.4),
        (box < 0.9) & (box > 0.55),
    )


def _smooth_noise(rng, n, side):
    """Low-frequency texture in [-1, 1]: 6x6 noise, bilinearly upsampled."""
    coarse = rng.uniform(-1, 1, (n, 1, 6, 6))
    grid = numpy.linspace(0, 5, side)
    i0 = numpy.floor(grid).astype(int).clip(0, 4)
    w = (grid - i0)[:, None]
    rows = coarse[:, :, i0] * (1 - w) + coarse[:, :, i0 + 1] * w
    w = w[:, 0]
    return rows[..., i0] * (1 - w) + rows[..., i0 + 1] * w


def generate(n, seed):
    """``(x, y)``: ``n`` images (float32, N x 3 x 24 x 24, about zero mean,
    unit scale) and their labels (int32)."""
    rng = numpy.random.RandomState(seed)
    y = (numpy.arange(n) % len(CLASSES)).astype(numpy.int32)
    rng.shuffle(y)
    coords = numpy.arange(SIZE) + 0.5
    py, px = numpy.meshgrid(coords, coords, indexing='ij')
    bg = rng.uniform(0, 1, (n, 3, 1, 1))
    fg = rng.uniform(0, 1, (n, 3, 1, 1))
    # Keep the shape visible: at least 0.35 apart from the background.
    near = numpy.linalg.norm((fg - bg)[:, :, 0, 0], axis=1) < 0.35
    fg[near] = 1.0 - bg[near]
    x = bg + 0.15 * _smooth_noise(rng, n, SIZE) * rng.uniform(
        0.5, 1.5, (n, 3, 1, 1))
    radius = rng.uniform(3.5, 7.0, n)
    cx, cy = (rng.uniform(radius, SIZE - radius) for _ in range(2))
    theta = numpy.deg2rad(rng.uniform(-35, 35, n))
    cos, sin = numpy.cos(theta), numpy.sin(theta)
    for i in range(n):
        dx, dy = px - cx[i], py - cy[i]
        u = (cos[i] * dx + sin[i] * dy) / radius[i]
        v = (-sin[i] * dx + cos[i] * dy) / radius[i]
        mask = _masks(u, v)[y[i]]
        x[i][:, mask] = fg[i, :, 0]
    # The distractor: a blob of a third colour, radius 1.5 to 3.5 pixels.
    blob = rng.uniform(0, 1, (n, 3))
    bx, by = rng.uniform(0, SIZE, (2, n))
    br = rng.uniform(1.5, 3.5, n)
    hit = (numpy.hypot(px[None] - bx[:, None, None],
                       py[None] - by[:, None, None]) < br[:, None, None])
    x = numpy.where(hit[:, None], blob[:, :, None, None], x)
    x = x + rng.normal(0, 0.12, x.shape)
    return ((x - 0.5) / 0.3).astype(numpy.float32), y


def load(n_train=20000, n_val=5000, seed=0):
    """``((x_train, y_train), (x_val, y_val))`` from disjoint seeds."""
    return generate(n_train, seed), generate(n_val, seed + 10007)
