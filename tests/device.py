"""The device the numerical tests run their links on.

``pytest --device=@cupy:0`` runs them on the first GPU (CuPy arrays);
the default, ``@numpy``, on the CPU. References are always computed on the
CPU, in NumPy, so every comparison reads device results back with
:func:`host`.
"""
import chainer

_selected = [chainer.get_device('@numpy')]


def select(spec):
    device = chainer.get_device(spec)
    device.use()
    _selected[0] = device


def current():
    return _selected[0]


def on_gpu():
    return current().xp is not chainer.backend.CpuDevice().xp


def send(*arrays):
    """``arrays`` on the selected device (one array alone if one given)."""
    out = tuple(current().send(a) for a in arrays)
    return out[0] if len(out) == 1 else out


def place(link):
    """``link`` moved to the selected device."""
    return link.to_device(current())


def host(array):
    """A NumPy copy (or the array itself) of a device result."""
    return chainer.backend.CpuDevice().send(array)
