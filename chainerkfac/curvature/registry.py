"""Which Fisher block serves which link class.

Adding support for a link type means one block class and one
:func:`register` call::

    chainerkfac.curvature.register(MyLink, MyLinkBlock)

Lookup follows the link's class hierarchy, so subclasses of a registered
link are served by its block (unless registered themselves).
"""
import chainer.links as L

from chainerkfac.curvature import base
from chainerkfac.curvature import batch_normalization
from chainerkfac.curvature import convolution_2d
from chainerkfac.curvature import cost
from chainerkfac.curvature import linear

_blocks = {}


def register(link_class, block_class):
    """Serves links of ``link_class`` (and its subclasses) by
    ``block_class``."""
    _blocks[link_class] = block_class


def lookup(link):
    """The block class for ``link``, or ``None`` if no block is registered."""
    for cls in type(link).__mro__:
        if cls in _blocks:
            return _blocks[cls]
    return None


def blocks_of(model, options):
    """``(blocks, unsupported)``: a block for every link of ``model`` that
    a registered block serves (in ``namedlinks`` order, named by its path),
    and ``(name, reason)`` for each link that holds parameters but gets
    none (its parameters follow momentum SGD)."""
    blocks, unsupported = [], []
    for path, child in model.namedlinks(skipself=False):
        name = path.strip('/') or '(root)'
        block_class = lookup(child)
        if block_class is None:
            if _owns_parameters(child):
                unsupported.append((name, 'no Fisher block for {}'.format(
                    type(child).__name__)))
            continue
        block_class = block_class.for_link(child, options)
        reason = block_class.unsupported_reason(child)
        if reason is not None:
            unsupported.append((name, reason))
            continue
        blocks.append(block_class(child, name, options))
    return blocks, unsupported


def _owns_parameters(link):
    """Whether ``link`` holds parameters itself (not only in children)."""
    return any(name.count('/') == 1
               for name, _ in link.namedparams(include_uninit=True))


register(L.Linear, linear.LinearBlock)
register(L.Convolution2D, convolution_2d.Convolution2DBlock)
# The same im2col Kronecker factors, with its dilation (not a subclass).
register(L.DilatedConvolution2D, convolution_2d.Convolution2DBlock)
register(L.BatchNormalization, batch_normalization.BatchNormalizationBlock)


def gradient_loss_scale(blocks, default=None):
    """The loss scale the gradients of ``blocks`` carry (that of their
    backward, which a manual loop may pass without Chainer's
    ``loss_scaling()``), from the first block with a shape; ``default``
    where none has one (a lazily initialised link not yet called has no
    gradient to say it)."""
    shaped = next((block for block in blocks if block.shaped()), None)
    return default if shaped is None else shaped.gradient_loss_scale()


def warn_unsupported(unsupported):
    """Names on :data:`chainerkfac.curvature.base.fallback_logger` each
    link of ``unsupported`` (``(name, reason)`` pairs of
    :func:`blocks_of`), whose parameters follow momentum SGD."""
    if unsupported:
        base.fallback_logger.warning(
            'KFAC: %d link(s) without curvature follow momentum SGD: %s',
            len(unsupported), '; '.join('{} ({})'.format(name, reason)
                                        for name, reason in unsupported))


def coverage(model, blocks, unsupported, placement=None, works=None):
    """The lines of a table of what updates each link of ``model``: each
    of ``blocks`` (with its estimated work over its passes, from
    ``works[i]``, a :class:`~chainerkfac.curvature.cost.StepWork` or
    ``None``, and the rank that owns it, ``placement[i]``, in a distributed
    run), each link of ``unsupported`` (``(name, reason)`` pairs: momentum
    SGD), the other parameters that momentum SGD updates, those nothing
    updates (added after setup), and the whole model's work."""
    works = works or [None] * len(blocks)
    ratios = [work and work.ratios() for work in works]
    notes = [None if r is None else
             'work: stale {:.2f}x, refresh {:.2f}x its passes'.format(*r)
             for r in ratios]
    covered = {id(p) for b in blocks for p in b.params()}
    params = list(model.namedparams(include_uninit=True))
    # A parameter added after setup has no update rule: nothing updates
    # it, as with MomentumSGD.
    frozen = [name for name, p in params if p.update_rule is None]
    sgd = [name for name, p in params
           if id(p) not in covered and p.update_rule is not None]
    rows = [(b.name, '; '.join(
        [b.describe()]
        + ([] if notes[i] is None else [notes[i]])
        + ([] if placement is None else [placement[i]])))
        for i, b in enumerate(blocks)]
    rows += [(name, 'momentum SGD: {}'.format(reason))
             for name, reason in unsupported]
    width = max([len(r[0]) for r in rows] + [4])
    lines = ['  {:<{}}  {}'.format(n, width, d) for n, d in rows]
    if sgd:
        lines.append('  momentum SGD parameters: {}'.format(', '.join(sgd)))
    if frozen:
        lines.append('  not updated (added after setup; call setup again): '
                     '{}'.format(', '.join(frozen)))
    whole = cost.total(works)
    if whole is not None and whole.ratios() is not None:
        lines.append(
            '  K-FAC\'s work per step, estimated at the last training '
            "pass's batch, over the K-FAC layers' forward and backward "
            'passes: stale step {:.2f}x, refresh step {:.2f}x'.format(
                *whole.ratios()))
    return lines
