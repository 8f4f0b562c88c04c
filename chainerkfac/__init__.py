"""chainerkfac: distributed K-FAC for Chainer, ChainerMN and CuPy.

``import chainerkfac`` works without CuPy or a GPU. The compatibility layer
is applied before Chainer is imported (see :mod:`chainerkfac._compat`).
"""
from chainerkfac import _compat  # NOQA  (must precede any Chainer import)

# The public packages: what a user imports or names in an option.
from chainerkfac import averaging  # NOQA
from chainerkfac import curvature  # NOQA
from chainerkfac import divergence  # NOQA
from chainerkfac import optimizers  # NOQA
from chainerkfac import schedules  # NOQA
from chainerkfac import step_rule  # NOQA
from chainerkfac.averaging import AveragedEvaluator  # NOQA
from chainerkfac.averaging import PolyakAveraging  # NOQA
from chainerkfac.curvature import NonFiniteError  # NOQA
from chainerkfac.divergence import DivergenceError  # NOQA
from chainerkfac.divergence import DivergenceWarning  # NOQA
from chainerkfac.divergence import StallWarning  # NOQA
from chainerkfac.distributed import create_communicator  # NOQA
from chainerkfac.distributed import create_multi_node_optimizer  # NOQA
from chainerkfac.optimizers.snapshot import files as snapshot_files  # NOQA
from chainerkfac.optimizers.snapshot import load as load_snapshot  # NOQA

__version__ = '0.1.0'

__all__ = ['averaging', 'curvature', 'divergence', 'optimizers',
           'schedules', 'step_rule', 'PolyakAveraging', 'AveragedEvaluator',
           'NonFiniteError', 'DivergenceError',
           'DivergenceWarning', 'StallWarning',
           'create_communicator', 'create_multi_node_optimizer',
           'snapshot_files', 'load_snapshot']
