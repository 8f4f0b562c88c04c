"""Rank script: rank 1 raises while rank 0 waits in a collective.

Without the global except hook rank 0 would wait for ever; with it (installed
by create_communicator) the job must end at once with a non-zero status.
"""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

from chainerkfac.distributed import create_communicator

comm = create_communicator('naive')
if comm.rank == 1:
    raise RuntimeError('deliberate failure on rank 1')
comm.mpi_comm.Barrier()
print('rank 0 passed a barrier that rank 1 never reached', flush=True)
