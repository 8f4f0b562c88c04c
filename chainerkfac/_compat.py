"""Compatibility layer between Chainer 7.8.1 and current NumPy / CuPy.

Imported by :mod:`chainerkfac` before anything imports Chainer. Each shim says
why it exists; see also ``chainerkfac_numpy_compat`` (top level), which the
installed ``.pth`` hook applies even when ``import chainer`` comes first.
"""
import chainerkfac_numpy_compat

chainerkfac_numpy_compat.apply()
