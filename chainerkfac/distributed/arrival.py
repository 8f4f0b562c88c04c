"""Deadlines on what the ranks wait for, naming the ranks that keep the
others waiting (:func:`chainerkfac.create_multi_node_optimizer`'s
``arrival_deadline``).

- :class:`Watch`: a collective of the step (its start's check of the
  iteration too), started without blocking and waited for with the
  deadline. A rank that times out calls the roll (:func:`roll_call`):
  every rank that is waiting too answers with what it waits for, and the
  ranks that do not answer within :data:`GRACE` seconds are named as
  stopped, blocked or gone from the training loop.
- :func:`rendezvous`: every rank's small value, or the names of the ranks
  that did not send theirs in time: what names each rank's iteration
  where the start's check found that they differ.

A blocking collective could only wait, and the ranks that never arrive
would stay unknown.
"""
import time


class ArrivalTimeout(RuntimeError):
    """Ranks did not reach a collective of the step, or
    :func:`rendezvous`, in time."""


#: The tag of :func:`rendezvous`'s messages (on a communicator of their
#: own), and those of the roll call and its answers.
_ARRIVAL_TAG = 2039
_ROLL_TAG = 2040
_ANSWER_TAG = 2041
#: Seconds a rank that timed out waits for the others' answers.
GRACE = 2.0


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
        _wait(comm, pending, values, start, deadline, what,
              lambda ranks: 'rank(s) ' + ', '.join(map(str, ranks)))
        everyone = [values[r] for r in range(size)]
        for r in range(1, size):
            comm.send(everyone, dest=r, tag=_ARRIVAL_TAG)
        return everyone
    sent = comm.isend(value, dest=0, tag=_ARRIVAL_TAG)
    answer = {0: comm.irecv(source=0, tag=_ARRIVAL_TAG)}
    received = {}
    _wait(comm, answer, received, start,
          None if deadline is None else 1.1 * deadline + 5, what,
          lambda ranks: "rank 0, which gathers every rank's arrival,")
    sent.wait()
    return received[0]


def _wait(comm, pending, values, start, deadline, what, who):
    """:func:`_collect` until none of ``pending`` is; after ``deadline``
    seconds from ``start`` raises :class:`ArrivalTimeout`, naming the ranks
    still pending by ``who(ranks)``. Answers the roll calls of ranks that
    timed out elsewhere (``what``: where this one waits)."""
    pauses = _pauses()
    while pending:
        _collect(pending, values)
        if not pending:
            return
        answer_roll_calls(comm, 'the start of ' + what)
        waited = time.monotonic() - start
        if deadline is not None and waited > deadline:
            raise ArrivalTimeout(
                '{}: waited {:g} s for {} to start it: a rank that left '
                'its training loop early, or is still busy with work of its '
                'own (every rank calls update() as many times; '
                'create_multi_node_optimizer(..., arrival_deadline=None) '
                'waits for ever)'.format(what, deadline, who(sorted(pending))))
        time.sleep(next(pauses))


def _collect(pending, values):
    """Moves the values of the completed requests of ``pending`` (rank ->
    request) into ``values``."""
    for r, request in list(pending.items()):
        done, value = request.test()
        if done:
            values[r] = value
            del pending[r]


def _pauses():
    """A growing pause between polls (up to 2 ms), so that a waiting rank
    leaves its core to the ones at work; growing by a quarter, a
    collective's end is seen at most about a quarter of its time late."""
    pause = 1e-5
    while True:
        yield pause
        pause = min(1.25 * pause, 2e-3)


def answer_roll_calls(comm, where):
    """Answers every roll call waiting on ``comm`` with ``where``."""
    import mpi4py.MPI
    status = mpi4py.MPI.Status()
    while comm.iprobe(source=mpi4py.MPI.ANY_SOURCE, tag=_ROLL_TAG,
                      status=status):
        caller = status.Get_source()
        comm.recv(source=caller, tag=_ROLL_TAG)
        comm.send(where, dest=caller, tag=_ANSWER_TAG)


def roll_call(comm, where):
    """``{rank: what it waits for}`` of the other ranks that answer within
    :data:`GRACE` seconds (answering theirs meanwhile, with ``where``)."""
    others = [r for r in range(comm.size) if r != comm.rank]
    for r in others:
        comm.isend(None, dest=r, tag=_ROLL_TAG)
    pending = {r: comm.irecv(source=r, tag=_ANSWER_TAG) for r in others}
    answers, start, pauses = {}, time.monotonic(), _pauses()
    while pending and time.monotonic() - start < GRACE:
        _collect(pending, answers)
        answer_roll_calls(comm, where)
        time.sleep(next(pauses))
    return answers


class Watch:
    """The deadline of the step's collectives on one communicator.

    ``comm`` is the mpi4py communicator of the roll call (the arrival's
    own duplicate); :attr:`deadline` (seconds, ``None``: wait for ever)
    and :attr:`step` (what the ranks are doing, for the messages) are set
    by the distributed stages at each update.
    """

    def __init__(self, comm):
        self.comm = comm
        self.deadline = None
        self.step = 'the K-FAC step'

    def wait(self, request, collective, start_of_step=False):
        """Waits for the MPI ``request`` of ``collective`` (its name);
        after :attr:`deadline` seconds calls the roll and raises
        :class:`ArrivalTimeout` naming the ranks that did not answer and
        where those that did are waiting. The wait at the start of a step
        lasts ``1.1 deadline + 5`` s, so that a rank left in the middle of
        the last step names the one that went on, not the other way
        round."""
        if self.deadline is None or self.comm.size == 1:
            request.Wait()
            return
        deadline = 1.1 * self.deadline + 5 if start_of_step else \
            self.deadline
        where = '{} of {}'.format(collective, self.step)
        start, pauses = time.monotonic(), _pauses()
        while not request.Test():
            answer_roll_calls(self.comm, where)
            waited = time.monotonic() - start
            if waited > deadline:
                answers = roll_call(self.comm, where)
                raise ArrivalTimeout(_absent(
                    where, deadline, answers, self.comm.rank,
                    self.comm.size))
            time.sleep(next(pauses))


def _absent(where, deadline, answers, rank, size):
    """The message of a rank that waited ``deadline`` s in ``where``."""
    silent = [r for r in range(size) if r != rank and r not in answers]
    elsewhere = {r: a for r, a in answers.items() if a != where}
    parts = []
    if silent:
        parts.append('rank(s) {} did not answer: stopped, exited or '
                     'blocked in the middle of the step, or left its '
                     'training loop early (every rank calls update() as '
                     'many times)'.format(', '.join(map(str, silent))))
    parts += ['rank {} waits in {} (it left this step: an exception it '
              'caught, or a loop of its own)'.format(r, a)
              for r, a in sorted(elsewhere.items())]
    return 'waited {:g} s in {}: {}'.format(
        deadline, where, '; '.join(parts) or 'every rank waits here too')
