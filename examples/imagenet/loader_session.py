"""Puts the data-loading processes in a session of their own.

``train.py`` has the forkserver that forks the ``MultiprocessIterator``
workers import this module first. ``mpiexec`` forwards SIGTERM to the whole
process group of each training process; in that group the loaders would die
at once, and the training process would wait forever for the batches they
were loading instead of stopping at the end of the iteration (``signal_stop``)
and terminating them itself. In their own session they receive no group
signal. They still exit when the training process dies: their pipes close.
"""
import os

os.setsid()
