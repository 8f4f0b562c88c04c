"""Launching real multi-process MPI runs from tests.

``run_mpi(n, script)`` starts ``mpiexec -n n <python> script`` with the
repository root on ``PYTHONPATH`` (so the ranks import the source tree, not
an installed copy) and returns ``(returncode, stdout, stderr)``. A run that
outlives ``timeout`` is killed, with every process it started, and fails the
test: a hung collective must not hang the test suite.

Rank scripts should ``import chainerkfac`` before ``chainer`` (Chainer 7.8
needs its NumPy-2 shims) and end with an exception, or a non-zero exit, on
failure.
"""
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           'mpi_scripts')

MPIResult = collections.namedtuple('MPIResult',
                                   ['returncode', 'stdout', 'stderr'])


def find_mpiexec():
    """The ``mpiexec`` beside the running interpreter (the ``mpich`` wheel
    installs it in the virtual environment's ``bin``), else the one on
    ``PATH``. Fails the test when there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which('mpiexec')
    if found is None:
        pytest.fail('mpiexec not found beside {} nor on PATH; install the '
                    'requirements (the mpich wheel provides it)'.format(
                        sys.executable))
    return found


def script_path(name):
    """Path of a rank script in ``tests/mpi_scripts``."""
    return os.path.join(SCRIPTS_DIR, name)


def run_mpi(nprocs, script, args=(), timeout=60, env=None, check=False):
    """Runs ``script`` on ``nprocs`` MPI ranks and returns an
    :class:`MPIResult`.

    Args:
        nprocs (int): Number of ranks (oversubscribing the cores is fine).
        script (str): Path of a Python file, or Python source code (any
            string that is not an existing file), run by every rank.
        args: Command-line arguments for the script.
        timeout (float): Seconds before the run is killed and the test
            fails.
        env (dict): Variables to add to the environment. BLAS and OpenMP
            default to one thread per rank, as ranks share the cores.
        check (bool): Fail the test, showing both outputs, unless the run
            exits with status 0.
    """
    run_env = dict(os.environ)
    run_env['PYTHONPATH'] = os.pathsep.join(
        [REPO_ROOT] + [p for p in [run_env.get('PYTHONPATH')] if p])
    for var in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
        run_env.setdefault(var, '1')
    run_env.update(env or {})

    with tempfile.TemporaryDirectory() as tmp:
        if os.path.isfile(script):
            path = script
        else:
            path = os.path.join(tmp, 'rank_script.py')
            with open(path, 'w') as f:
                f.write(script)
        command = [find_mpiexec(), '-n', str(nprocs), sys.executable, path]
        command += [str(a) for a in args]
        # A session of its own, so that on timeout the launcher and all the
        # ranks it started can be killed together.
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=run_env, cwd=REPO_ROOT, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # every process had already exited
                pass
            stdout, stderr = process.communicate()
            pytest.fail('{} timed out after {} s\n--- stdout ---\n{}\n'
                        '--- stderr ---\n{}'.format(
                            ' '.join(command), timeout, stdout, stderr))

    result = MPIResult(process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        pytest.fail(describe(result, command))
    return result


def describe(result, command=None):
    """A failure message showing a run's status and outputs."""
    head = 'exit status {}'.format(result.returncode)
    if command:
        head = '{}: {}'.format(' '.join(command), head)
    return '{}\n--- stdout ---\n{}\n--- stderr ---\n{}'.format(
        head, result.stdout, result.stderr)
