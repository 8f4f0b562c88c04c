"""A snapshot resumes exactly: k steps, save, fresh process, k more steps."""
import os
import subprocess
import sys

import numpy
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(tmp_path, name, start, stop, inverse, resume=None):
    out = str(tmp_path / name)
    cmd = [sys.executable, os.path.join(HERE, 'resume_run.py'),
           str(start), str(stop), out, '--inverse', inverse]
    if resume:
        cmd += ['--resume', resume]
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run(cmd, check=True, env=env, timeout=120)
    return out + '.npz'


@pytest.mark.parametrize('inverse', ['cholesky', 'eigen'])
def test_resumed_run_equals_uninterrupted_run(tmp_path, inverse):
    k = 5
    straight = numpy.load(run(tmp_path, 'straight', 0, 2 * k, inverse))
    half = run(tmp_path, 'half', 0, k, inverse)
    resumed = numpy.load(run(tmp_path, 'resumed', k, 2 * k, inverse,
                             resume=half))
    assert set(straight.files) == set(resumed.files)
    assert any('kfac/fc/A' in key for key in straight.files)
    for key in straight.files:
        numpy.testing.assert_array_equal(straight[key], resumed[key],
                                         err_msg=key)
