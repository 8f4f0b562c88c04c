"""Families of inverse forms: which :mod:`~chainerkfac.curvature.forms` a
kind of block may hold, how a refresh builds one from the factors (for an
inverse expected to serve ``reuse`` steps), the damping policy of
:mod:`chainerkfac.linalg` it is built with, and how a snapshot's arrays
become a form again.
"""
import functools

from chainerkfac import linalg
from chainerkfac.curvature import forms
from chainerkfac.curvature.forms import (
    DenseEigen, DenseInverse, Diagonal, DoublyFactoredInverses,
    KroneckerCholesky, KroneckerEigen, KroneckerInverses, KroneckerMixed)


class Family:
    """The forms the options give a kind of block.

    Attributes:
        kinds (tuple): The :class:`~chainerkfac.curvature.forms.Form`
            classes it may hold (what a snapshot may hold).
        build: ``build(factors, damping, reuse)``, the form a refresh
            makes of the factors (a tuple, in the block's factor order)
            for an inverse expected to serve ``reuse`` steps.
        damping: ``damping(hyperparam)``, the damping the block's forms
            are built with (a policy of :mod:`chainerkfac.linalg`).
    """

    def __init__(self, kinds, build, damping):
        self.kinds = kinds
        self.build = build
        self.damping = damping

    def rebuilds(self, form):
        """Whether a snapshot may store ``form``'s kind and damping alone
        and :meth:`rebuild` it from the factors it was built from (not a
        split block's mixed form, whose parts the split decides)."""
        return type(form) in self.kinds and type(form) is not KroneckerMixed

    def rebuild(self, kind, factors, damping):
        """The form of ``kind`` that a refresh built from ``factors`` at
        ``damping``: the same computation, so the same numbers."""
        if len(self.kinds) == 1:
            return self.build(factors, damping, 1)
        return kind.refreshed(*factors, damping)


def _tikhonov(factors, damping, reuse):
    A, G = factors
    return forms.tikhonov_kind(len(A), len(G), reuse).refreshed(A, G,
                                                                damping)


def _refreshed(kind, factors, damping, reuse):
    return kind.refreshed(*factors, damping)


def _single(kind):
    # A partial of a module-level function, not a closure, so that a block
    # (and the optimizer and model holding it) pickles.
    return functools.partial(_refreshed, kind)


#: Kronecker blocks, by the ``inverse`` option of
#: :class:`~chainerkfac.optimizers.KFAC`.
KRONECKER = {
    'cholesky': Family((KroneckerInverses, KroneckerCholesky, KroneckerMixed),
                       _tikhonov, linalg.layer_damping),
    'eigen': Family((KroneckerEigen,), _single(KroneckerEigen),
                    linalg.layer_damping),
}


def _doubly_factored(factors, damping, reuse, bias):
    return DoublyFactoredInverses.refreshed(*factors, damping, bias=bias)


def doubly_factored(bias):
    """The family of a doubly-factored block, with or without a bias: its
    factors are small by construction, so explicit inverses serve every
    reuse (under either ``inverse`` option: the three π's are the point
    of Ba et al.'s §4.1)."""
    return Family((DoublyFactoredInverses,),
                  functools.partial(_doubly_factored, bias=bias),
                  linalg.layer_damping)


def _batch_norm(kind):
    return Family((kind,), _single(kind), linalg.batch_norm_damping)


#: BatchNorm blocks, by the ``(bn_fisher, inverse)`` options.
BATCH_NORM = {
    ('diagonal', 'cholesky'): _batch_norm(Diagonal),
    ('diagonal', 'eigen'): _batch_norm(Diagonal),
    ('full', 'cholesky'): _batch_norm(DenseInverse),
    ('full', 'eigen'): _batch_norm(DenseEigen),
}


def snapshot_keys(kinds):
    """The arrays a block whose form is one of ``kinds`` stores (each with
    a flag saying whether it is present), in a fixed order."""
    keys = []
    for kind in kinds:
        keys += [key for key in kind.keys if key not in keys]
    return tuple(keys)


def restore(kinds, arrays, damping):
    """The form of ``kinds`` that stored ``arrays`` (``None`` if empty)."""
    if not arrays:
        return None
    for kind in kinds:
        if kind.matches(arrays):
            return kind(dict(arrays), damping)
    raise ValueError('snapshot holds inverse arrays {} that no form of {} '
                     'stores'.format(sorted(arrays),
                                     [k.__name__ for k in kinds]))
