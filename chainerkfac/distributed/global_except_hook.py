"""End the whole MPI job when one rank dies of an uncaught exception.

A rank that dies while the others wait in a collective leaves them waiting
for ever: many MPI launchers do not notice a Python process that exits
without ``MPI_Finalize``, and those that do may wait for a timeout. Like
ChainerMN's ``global_except_hook`` (which is off unless an environment
variable is set), the hook prints the rank and the traceback and calls
``MPI_Abort`` on ``COMM_WORLD``, which makes ``mpiexec`` kill every rank and
exit with a non-zero status.

Only exceptions that reach the top of the main thread are caught:
exceptions in other threads and ``sys.exit`` are left alone (a
``sys.exit`` in the middle of a distributed K-FAC step aborts the job
through :func:`abort`, as the other ranks wait in its collectives).
"""
import sys
import time
import traceback

#: Seconds between writing the report and ``MPI_Abort``: the launcher
#: forwards a rank's output asynchronously and drops what is still in flight
#: when it kills the job (seen once in the test suite on a loaded machine:
#: an aborted run with empty outputs).
REPORT_GRACE = 0.5


def install_global_except_hook():
    """Makes an uncaught exception on this rank abort every rank.

    :func:`~chainerkfac.distributed.create_communicator` calls this when
    there is more than one rank (``abort_on_exception=True``, the default).
    Calling it again does nothing.
    """
    if sys.excepthook is not _abort_on_uncaught_exception:
        sys.excepthook = _abort_on_uncaught_exception


def _abort_on_uncaught_exception(exc_type, exc, tb):
    abort('uncaught exception',
          ''.join(traceback.format_exception(exc_type, exc, tb)))


def abort(reason, report=''):
    """Writes ``reason`` (and ``report``, a traceback), every line marked
    with this rank, then calls ``MPI_Abort`` on ``COMM_WORLD``: the launcher
    ends every rank and exits with a non-zero status."""
    import mpi4py.MPI
    world = mpi4py.MPI.COMM_WORLD
    rank = world.Get_rank()
    try:
        # Every line carries the rank: mpiexec interleaves the ranks'
        # outputs.
        sys.stderr.write(
            '[rank {}] chainerkfac: {} on rank {} of {}; calling MPI_Abort '
            'to end the job\n'.format(rank, reason, rank, world.Get_size())
            + ''.join('[rank {}] {}'.format(rank, line)
                      for line in report.splitlines(True)))
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(REPORT_GRACE)
    finally:
        world.Abort(1)
