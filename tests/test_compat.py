"""The environment the README builds: Chainer imports on NumPy 1.26 and 2.x."""
import os
import shutil
import subprocess
import sys
import zipfile

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = 'chainerkfac-numpy-compat.pth'


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


def test_editable_installs_ship_the_start_up_hook(tmp_path):
    # `pip install -e .` builds a PEP 660 editable wheel, or, without PEP
    # 517, runs `setup.py develop`: either must leave the hook that makes
    # `import chainer` work before `import chainerkfac` on NumPy 2. Built
    # from a copy of the sources, so that no build output lands in the
    # repository.
    src = tmp_path / 'src'
    shutil.copytree(os.path.join(ROOT, 'chainerkfac'), src / 'chainerkfac',
                    ignore=shutil.ignore_patterns('__pycache__'))
    for name in ('setup.py', PTH, 'chainerkfac_numpy_compat.py'):
        shutil.copy(os.path.join(ROOT, name), src / name)
    wheels = tmp_path / 'wheels'
    build = subprocess.run(
        [sys.executable, '-c', 'import sys\n'
         'from setuptools import build_meta\n'
         'print(build_meta.build_editable(sys.argv[1]))', str(wheels)],
        cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    with zipfile.ZipFile(wheels / build.stdout.split()[-1]) as wheel:
        assert PTH in wheel.namelist()
    site = tmp_path / 'site'
    site.mkdir()
    develop = subprocess.run(
        [sys.executable, 'setup.py', '--quiet', 'develop', '--no-deps',
         '--install-dir', str(site)], cwd=src, capture_output=True,
        text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(site)))
    assert develop.returncode == 0, develop.stderr
    # An interpreter that reads the develop install's site folder (its
    # .pth files, the hook's among them) has the hook before any import.
    result = run_python(
        'import site, sys\n'
        'sys.modules.pop("chainerkfac_numpy_compat", None)\n'
        'site.addsitedir({!r})\n'
        'assert "chainerkfac_numpy_compat" in sys.modules\n'
        'import chainer\n'.format(str(site)))
    assert result.returncode == 0, result.stderr
