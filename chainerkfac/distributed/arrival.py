"""A rendezvous with a deadline: every rank's small value, or the names of
the ranks that did not send theirs in time. A blocking collective could
only wait, and the ranks that never arrive would stay unknown; this names
a rank that left its training loop early
(:func:`chainerkfac.create_multi_node_optimizer`'s ``arrival_deadline``).
"""
import time


class ArrivalTimeout(RuntimeError):
    """Ranks did not reach :func:`rendezvous` in time."""


#: The tag of :func:`rendezvous`'s messages (on a communicator of their
#: own).
_ARRIVAL_TAG = 2039


def rendezvous(comm, value, deadline, what):
    """Every rank's ``value`` (a small picklable object), in rank order,
    over the mpi4py communicator ``comm``.

    Rank 0 collects the values point to point and sends every rank the
    list. With ``deadline`` seconds (``None``: wait for ever), rank 0
    raises :class:`ArrivalTimeout` naming the ranks whose value did not
    come in that time and ``what`` they were to start (the global except
    hook then ends the job); another rank waits a little longer for rank
    0's answer before naming rank 0.
    """
    size = comm.size
    if size == 1:
        return [value]
    rank, start = comm.rank, time.monotonic()
    if rank == 0:
        pending = {r: comm.irecv(source=r, tag=_ARRIVAL_TAG)
                   for r in range(1, size)}
        values = {0: value}
        _wait(pending, values, start, deadline, what,
              lambda ranks: 'rank(s) ' + ', '.join(map(str, ranks)))
        everyone = [values[r] for r in range(size)]
        for r in range(1, size):
            comm.send(everyone, dest=r, tag=_ARRIVAL_TAG)
        return everyone
    sent = comm.isend(value, dest=0, tag=_ARRIVAL_TAG)
    answer = {0: comm.irecv(source=0, tag=_ARRIVAL_TAG)}
    received = {}
    _wait(answer, received, start,
          None if deadline is None else 1.1 * deadline + 5, what,
          lambda ranks: "rank 0, which gathers every rank's arrival,")
    sent.wait()
    return received[0]


def _wait(pending, values, start, deadline, what, who):
    """Moves the values of the completed requests of ``pending`` (rank ->
    request) into ``values`` until none is pending; after ``deadline``
    seconds from ``start`` raises :class:`ArrivalTimeout`, naming the ranks
    still pending by ``who(ranks)``. Polls with a growing pause (up to
    2 ms), so that a waiting rank leaves its core to the ones at work."""
    pause = 1e-5
    while pending:
        for r, request in list(pending.items()):
            done, value = request.test()
            if done:
                values[r] = value
                del pending[r]
        if not pending:
            return
        waited = time.monotonic() - start
        if deadline is not None and waited > deadline:
            raise ArrivalTimeout(
                '{}: waited {:.0f} s for {} to start it: a rank that left '
                'its training loop early, or is still busy with work of its '
                'own (every rank calls update() as many times; '
                'create_multi_node_optimizer(..., arrival_deadline=None) '
                'waits for ever)'.format(what, waited, who(sorted(pending))))
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)
