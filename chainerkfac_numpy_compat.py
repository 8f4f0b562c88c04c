"""NumPy-2 shims that Chainer 7.8.1 needs, applied before Chainer is imported.

Chainer 7.8.1 predates NumPy 2 and reads names NumPy has since removed:

* ``numpy.sctypes`` (removed in NumPy 2.0) is read at ``import chainer`` by
  ``chainer.functions.array.as_strided``; without it the import fails.
* ``numpy.float`` (removed in NumPy 1.24) is read by ``F.resize_images``.

Both are restored with their old meanings. Nothing else is touched: names that
NumPy still defines are never overwritten.

The installed ``chainerkfac-numpy-compat.pth`` file calls :func:`install` at
interpreter start-up; it registers an import hook that applies the shims the
first time ``chainer`` is imported, so ``import chainer`` works even when it
comes before ``import chainerkfac``. The hook imports nothing until then.
``chainerkfac`` also calls :func:`apply` itself before importing Chainer.
"""
import sys


def apply():
    """Restores the removed NumPy names Chainer 7.8.1 reads (idempotent)."""
    import numpy
    if 'sctypes' not in numpy.__dict__:
        numpy.sctypes = {
            'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
            'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
            'float': [numpy.float16, numpy.float32, numpy.float64,
                      numpy.longdouble],
            'complex': [numpy.complex64, numpy.complex128,
                        numpy.clongdouble],
            'others': [bool, object, bytes, str, numpy.void],
        }
    if 'float' not in numpy.__dict__:
        numpy.float = float


class _BeforeChainerImport:
    """Meta-path finder that applies the shims once, just before Chainer."""

    def find_spec(self, name, path=None, target=None):
        if name == 'chainer':
            sys.meta_path.remove(self)
            apply()
        return None  # the regular finders import the module


def install():
    """Registers the import hook (called from the ``.pth`` file)."""
    if 'chainer' in sys.modules:
        apply()
    elif not any(isinstance(f, _BeforeChainerImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeChainerImport())
