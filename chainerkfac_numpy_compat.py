"""NumPy-2 shims that Chainer 7.8.1 needs, applied before Chainer is imported.

Chainer 7.8.1 predates NumPy 2 and reads names NumPy has since removed:

* ``numpy.sctypes`` (removed in NumPy 2.0) is read at ``import chainer`` by
  ``chainer.functions.array.as_strided``; without it the import fails.
* ``numpy.float`` (removed in NumPy 1.24) is read by ``F.resize_images``.
* ``numpy.distutils.system_info`` (NumPy builds for Python 3.12 and later
  have no ``numpy.distutils``) is imported at ``import chainer`` by
  ``chainer._environment_check``, which calls its ``get_info('blas_opt')``
  on macOS only, to warn about Accelerate. Where ``numpy.distutils`` is
  missing, a stand-in module whose ``get_info`` finds nothing takes its place.

The names are restored with their old meanings. Nothing else is touched: what
NumPy still defines is never overwritten.

The installed ``chainerkfac-numpy-compat.pth`` file calls :func:`install` at
interpreter start-up; it registers an import hook that applies the shims the
first time ``chainer`` is imported, so ``import chainer`` works even when it
comes before ``import chainerkfac``. The hook imports nothing until then.
``chainerkfac`` also calls :func:`apply` itself before importing Chainer.
"""
import importlib.util
import sys
import types


def _distutils_stand_in():
    """``numpy.distutils`` with a ``system_info.get_info`` that finds no
    library (what it returns for a name it does not know)."""
    system_info = types.ModuleType('numpy.distutils.system_info')
    system_info.get_info = lambda name, notfound_action=0: {}
    distutils = types.ModuleType('numpy.distutils')
    distutils.system_info = system_info
    distutils.__path__ = []
    return distutils, system_info


def apply():
    """Restores the removed NumPy names Chainer 7.8.1 reads (idempotent)."""
    import numpy
    if sys.modules.get('numpy.distutils') is None and \
            importlib.util.find_spec('numpy.distutils') is None:
        distutils, system_info = _distutils_stand_in()
        sys.modules['numpy.distutils'] = distutils
        sys.modules['numpy.distutils.system_info'] = system_info
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
