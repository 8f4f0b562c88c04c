"""The environment the README builds: Chainer imports on NumPy 1.26 and 2.x."""
import subprocess
import sys

import numpy


def run_python(code):
    # A fresh interpreter: the installed start-up hook is what is tested.
    return subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=120)


def test_import_chainer_before_chainerkfac():
    result = run_python(
        'import chainer, numpy, chainer.functions as F\n'
        'x = numpy.ones((1, 1, 4, 4), numpy.float32)\n'
        'print(F.resize_images(x, (2, 2)).shape)\n')
    assert result.returncode == 0, result.stderr
    assert '(1, 1, 2, 2)' in result.stdout


def test_import_chainer_without_numpy_distutils():
    # NumPy for Python 3.12 and later has no numpy.distutils, which
    # chainer._environment_check imports.
    result = run_python(
        'import sys\n'
        'sys.modules["numpy.distutils"] = None  # its import now fails\n'
        'import chainer, numpy.distutils.system_info as s\n'
        'print(s.get_info("blas_opt"))\n')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '{}'


def test_import_chainerkfac_needs_no_cupy():
    result = run_python(
        'import sys\n'
        'sys.modules["cupy"] = None  # any import of cupy now fails\n'
        'import chainerkfac, chainer\n'
        'print(chainerkfac.optimizers.KFAC().lr)\n')
    assert result.returncode == 0, result.stderr


def test_shims_keep_numpy_names():
    # Names NumPy still has are never replaced.
    assert numpy.sctypes['float'][1] is numpy.float32
    assert numpy.float is float
