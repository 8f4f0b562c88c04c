"""Makes the ImageNet example's modules importable and prepares the digits.

The example is a folder of scripts, not a package: its modules are imported
the way ``train.py`` imports them, with the example folder on ``sys.path``.
"""
import os
import subprocess
import sys

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, 'examples', 'imagenet')
if EXAMPLE not in sys.path:
    sys.path.insert(0, EXAMPLE)


def _script_env():
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        [REPO, EXAMPLE] + [p for p in [env.get('PYTHONPATH')] if p])
    # One BLAS thread per process: the tests run two MPI processes on
    # small machines.
    env['OMP_NUM_THREADS'] = '1'
    return env


@pytest.fixture(scope='session')
def script_env():
    """Environment for scripts: the repository and the example importable.
    """
    return _script_env()


@pytest.fixture(scope='session')
def run_script(script_env):
    """``run_script(args, **subprocess_run_kwargs)`` -> CompletedProcess."""
    def run(args, **kwargs):
        return subprocess.run(args, env=script_env, capture_output=True,
                              text=True, **kwargs)
    return run


@pytest.fixture(scope='session')
def digits(tmp_path_factory, run_script):
    """``prepare.py digits`` output folder, prepared once per session."""
    out = tmp_path_factory.mktemp('digits')
    result = run_script([sys.executable, os.path.join(EXAMPLE, 'prepare.py'),
                         'digits', str(out), '--jobs', '2'], timeout=120)
    assert result.returncode == 0, result.stderr
    return out
