"""A snapshot resumes exactly: k steps, save, fresh process, k more steps."""
import os
import subprocess
import sys

import numpy
import pytest

from tests import mpi_helpers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


SCRIPT = os.path.join(HERE, 'resume_run.py')


def run(tmp_path, name, start, stop, inverse, resume=None):
    out = str(tmp_path / name)
    cmd = [sys.executable, SCRIPT, str(start), str(stop), out,
           '--inverse', inverse]
    if resume:
        cmd += ['--resume', resume]
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run(cmd, check=True, env=env, timeout=120)
    return out


def run_distributed(tmp_path, name, start, stop, resume=None, n=2,
                    extra=()):
    out = str(tmp_path / name)
    args = [str(start), str(stop), out, '--distributed'] + list(extra)
    if resume:
        args += ['--resume', resume]
    mpi_helpers.run_mpi(n, SCRIPT, args, timeout=120, check=True)
    return out


def assert_identical(straight, resumed):
    straight, resumed = numpy.load(straight), numpy.load(resumed)
    assert set(straight.files) == set(resumed.files)
    for key in straight.files:
        numpy.testing.assert_array_equal(straight[key], resumed[key],
                                         err_msg=key)
    return straight.files


@pytest.mark.parametrize('inverse', ['cholesky', 'eigen'])
def test_resumed_run_equals_uninterrupted_run(tmp_path, inverse):
    k = 5
    straight = run(tmp_path, 'straight', 0, 2 * k, inverse)
    half = run(tmp_path, 'half', 0, k, inverse)
    resumed = run(tmp_path, 'resumed', k, 2 * k, inverse, resume=half)
    keys = assert_identical(straight + '.npz', resumed + '.npz')
    assert any('kfac/fc/A' in key for key in keys)


def test_distributed_resume_equals_uninterrupted_run(tmp_path):
    # Each of the 2 ranks saves and resumes its own snapshot.
    k = 5
    straight = run_distributed(tmp_path, 'straight', 0, 2 * k)
    half = run_distributed(tmp_path, 'half', 0, k)
    resumed = run_distributed(tmp_path, 'resumed', k, 2 * k, resume=half)
    owned = []
    for rank in (0, 1):
        suffix = '.rank{}.npz'.format(rank)
        keys = assert_identical(straight + suffix, resumed + suffix)
        owned += [key for key in keys
                  if key.endswith('/A') and 'kfac' in key]
    # Every Kronecker factor is stored by exactly one rank, its owner.
    assert sorted(owned) == ['optimizer/kfac/conv/A', 'optimizer/kfac/fc/A']


def test_distributed_resume_with_split_blocks(tmp_path):
    # 2 of 3 ranks share the preconditioning of fc2, from its Cholesky
    # factors. What the other rank holds of them is not in the snapshots:
    # the owner sends it again on the first step after resuming.
    k = 5

    def run3(name, start, stop, resume=None):
        return run_distributed(tmp_path, name, start, stop, resume, n=3,
                               extra=['--mlp'])

    straight = run3('straight', 0, 2 * k)
    half = run3('half', 0, k)
    resumed = run3('resumed', k, 2 * k, resume=half)
    for rank in range(3):
        suffix = '.rank{}.npz'.format(rank)
        assert_identical(straight + suffix, resumed + suffix)
