"""The K-FAC communicator: real mpiexec runs, plus the world-size-1 path."""
import os
import subprocess
import sys
import time

import chainer.links as L
import numpy
import pytest

from chainerkfac.distributed import check_same_structure
from chainerkfac.distributed import create_communicator
from tests.mpi_helpers import REPO_ROOT
from tests.mpi_helpers import describe
from tests.mpi_helpers import run_mpi
from tests.mpi_helpers import script_path


def _gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver or no device
        return 0


@pytest.mark.parametrize('nprocs', [2, 4])
def test_collectives_match_numpy(nprocs):
    # reduce_scatter_v / all_gather_v with uneven and zero counts, float16
    # transport, allreduce_mean, bcast_array, bcast_data,
    # multi_node_mean_grad and the byte counters of each.
    result = run_mpi(nprocs, script_path('collectives.py'), timeout=120)
    assert result.returncode == 0, describe(result)
    for rank in range(nprocs):
        assert 'rank {}: ok'.format(rank) in result.stdout, describe(result)


@pytest.mark.skipif(_gpus() < 2, reason='needs CuPy, NCCL and two GPUs')
def test_collectives_match_numpy_nccl():
    result = run_mpi(2, script_path('collectives.py'), args=['pure_nccl'],
                     timeout=300)
    assert result.returncode == 0, describe(result)


def test_check_same_structure_names_parameter_and_ranks():
    result = run_mpi(2, script_path('structure_check.py'), timeout=120)
    assert result.returncode == 0, describe(result)
    assert 'rank 0: ok' in result.stdout and 'rank 1: ok' in result.stdout


def test_ranks_with_other_kfac_options_stop_at_setup_naming_them():
    result = run_mpi(2, script_path('options_check.py'), timeout=120)
    assert result.returncode == 0, describe(result)
    assert 'rank 0: ok' in result.stdout and 'rank 1: ok' in result.stdout


def test_chainermn_wrapper_around_kfac_is_refused_naming_the_call():
    result = run_mpi(2, script_path('chainermn_lines.py'), timeout=120)
    assert result.returncode == 0, describe(result)
    assert 'rank 0: ok' in result.stdout and 'rank 1: ok' in result.stdout


def test_exception_on_one_rank_ends_the_job():
    start = time.monotonic()
    result = run_mpi(2, script_path('raise_on_one_rank.py'), timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, describe(result)
    assert 'uncaught exception on rank 1 of 2' in result.stderr
    assert 'RuntimeError: deliberate failure on rank 1' in result.stderr
    assert 'passed a barrier' not in result.stdout
    # Two interpreters starting on two loaded cores take a few seconds; a
    # hang would last until the timeout.
    assert elapsed < 20, describe(result)


class _NoMPI:
    """Stands in for the mpi4py communicator of a one-rank job and fails
    on anything but its rank and size: at world size 1 the collectives must
    not reach MPI."""

    rank = 0
    size = 1

    def __getattr__(self, name):
        raise AssertionError('MPI called at world size 1: ' + name)


@pytest.fixture
def single():
    import mpi4py.MPI
    hook = sys.excepthook
    comm = create_communicator('naive', mpi_comm=mpi4py.MPI.COMM_SELF,
                               transport_dtype=numpy.float16)
    assert sys.excepthook is hook  # no abort hook for a single process
    comm.mpi_comm = _NoMPI()
    return comm


def test_world_size_one_is_copies_without_mpi(single):
    x = numpy.arange(5.0)
    for out in (single.reduce_scatter_v(x, [5]),
                single.all_gather_v(x, [5])):
        # A copy in the input's dtype, untouched by the float16 transport.
        assert out is not x and out.dtype == x.dtype
        numpy.testing.assert_array_equal(out, x)
    out, counts = single.alltoall_v(x, [5])
    assert out is not x and counts == [5]
    numpy.testing.assert_array_equal(out, x)
    assert single.allreduce_mean(x) is x
    assert single.bcast_array(x) is x
    assert single.group_bcast(x, 0, [0]) is x
    single.group_bcast(x, 0, [0], wait=False)()
    numpy.testing.assert_array_equal(x, numpy.arange(5.0))

    link = L.Linear(3, 2)
    link.cleargrads()
    single.bcast_data(link)
    single.multi_node_mean_grad(link)
    assert link.W.grad is None
    single.multi_node_mean_grad(link, zero_fill=True)
    numpy.testing.assert_array_equal(link.W.grad, numpy.zeros((2, 3)))
    check_same_structure(single, link)

    assert single.bytes_moved == {'allreduce': 0, 'reduce_scatter_v': 0,
                                  'all_gather_v': 0, 'alltoall_v': 0,
                                  'bcast': 0}


@pytest.mark.parametrize('call, match', [
    (lambda c: c.reduce_scatter_v(numpy.zeros(3), [2]), 'counts sum to 2'),
    (lambda c: c.reduce_scatter_v(numpy.zeros(3), [3, 0]), 'one per rank'),
    (lambda c: c.reduce_scatter_v(numpy.zeros(0), [-1]), 'non-negative'),
    (lambda c: c.reduce_scatter_v(numpy.zeros((1, 3)), [3]), '1-D'),
    (lambda c: c.all_gather_v(numpy.zeros(3), [2]), 'counts\\[0\\] is 2'),
    (lambda c: c.allreduce_mean(numpy.zeros((3, 2)).T), 'C-contiguous'),
    (lambda c: c.bcast_array(numpy.zeros(3, dtype=numpy.int64)), 'float'),
    (lambda c: c.group_bcast(numpy.zeros(3), 1, [0]), 'root 1 needs'),
    (lambda c: c.group_bcast(numpy.zeros(3), 0, [0, 0]), 'distinct ranks'),
    (lambda c: c.group_bcast(numpy.zeros(3), 0, [0, 1]), 'below 1'),
])
def test_invalid_arguments(single, call, match):
    with pytest.raises(ValueError, match=match):
        call(single)


def test_create_communicator_arguments():
    with pytest.raises(ValueError, match='unknown communicator'):
        create_communicator('flat')
    with pytest.raises(ValueError, match='pure_nccl'):
        create_communicator('naive', allreduce_grad_dtype=numpy.float16)
    with pytest.raises(ValueError, match='float dtype'):
        create_communicator('naive', transport_dtype=numpy.int32)


def test_config_in_chainermn_style():
    import mpi4py.MPI
    comm = create_communicator('naive', mpi_comm=mpi4py.MPI.COMM_SELF)
    assert comm.get_config('transport_dtype') is None
    comm.set_config('transport_dtype', 'float16')
    assert comm.get_config('transport_dtype') == numpy.float16
    comm.set_config('batched_copy', False)  # ChainerMN's own option
    assert comm.get_config('batched_copy') is False


@pytest.mark.skipif(_gpus() > 0, reason='CuPy and a GPU are present')
def test_pure_nccl_needs_cupy_only_when_asked_for():
    with pytest.raises(ImportError, match="'pure_nccl' needs CuPy with "
                       "NCCL and one GPU per process.*'naive' is the CPU "
                       "choice"):
        create_communicator('pure_nccl')


def test_import_neither_starts_mpi_nor_needs_cupy():
    # Importing mpi4py.MPI initializes MPI; a single-process user of
    # chainerkfac should not pay for (or need) either.
    code = ('import sys, chainerkfac, chainerkfac.distributed\n'
            'loaded = [m for m in ("mpi4py.MPI", "cupy")\n'
            '          if m in sys.modules]\n'
            'assert not loaded, loaded\n')
    subprocess.run([sys.executable, '-c', code], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=REPO_ROOT))


def test_run_mpi_reports_status_and_outputs():
    code = ('import sys\n'
            'import mpi4py.MPI\n'
            'rank = mpi4py.MPI.COMM_WORLD.Get_rank()\n'
            'print("rank {} {}".format(rank, sys.argv[1:]), flush=True)\n'
            'sys.exit(3 if rank == 0 else 0)\n')
    result = run_mpi(2, code, args=['a', 1], timeout=60)
    assert result.returncode == 3
    assert "rank 0 ['a', '1']" in result.stdout
    assert "rank 1 ['a', '1']" in result.stdout


def _alive(pid):
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            state = f.read().rsplit(')', 1)[1].split()[0]
    except OSError:
        return False
    return state != 'Z'


def test_run_mpi_kills_a_hung_run(tmp_path):
    code = ('import os, time\n'
            'open(os.path.join({!r}, str(os.getpid())), "w").close()\n'
            'time.sleep(600)\n'.format(str(tmp_path)))
    with pytest.raises(pytest.fail.Exception, match='timed out'):
        run_mpi(2, code, timeout=5)
    pids = [int(name) for name in os.listdir(tmp_path)]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))
