"""What a Fisher block saves and loads: its factors, refresh schedules and
inverse form (the one built in the background too), each array with an
entry saying whether and how it is stored (symmetric matrices and
triangular factors as one triangle), loaded arrays checked to be finite
and sent to the block's device.
"""
import numpy
from chainer import backend
from chainer import serializer as serializer_module

from chainerkfac import background
from chainerkfac.curvature import families


class SnapshotState:
    """The serialization of :class:`~chainerkfac.curvature.base.
    FisherBlock` (a mixin: it reads the block's ``factors``, ``factor``,
    ``schedules``, ``inverse_schedule``, ``form``, ``pending``,
    ``family``, ``name`` and ``params()``)."""

    def in_snapshot(self, deserializer):
        """Whether ``deserializer`` (this block's part of a snapshot) holds
        the block's state at all."""
        try:
            deserializer(_present_key(self.factors[0]), 0)
        except KeyError:
            return False
        return True

    def _serialize_array(self, serializer, key, value):
        loading = isinstance(serializer, serializer_module.Deserializer)
        layout = None if loading or value is None else _layout(value)
        present = int(serializer(_present_key(key), ABSENT if value is None
                                 else layout))
        if present == ABSENT:
            return None
        if loading:
            # A copy: the factors are folded in place, and a snapshot kept
            # in memory must not change with the run that loaded it.
            loaded = unpack(numpy.array(serializer(key, None)), present)
            if not numpy.isfinite(loaded).all():
                raise ValueError('snapshot holds a non-finite {} of K-FAC '
                                 'layer {}'.format(key, self.name))
            device = backend.get_device_from_array(self.params()[0].array)
            return device.send(loaded)
        serializer(key, _packed(value, layout))
        return value

    def serialize_schedules(self, serializer):
        """Saves or loads the factors' refresh schedules alone: what every
        process of a distributed run keeps of every block (it follows the
        owner's refreshes), the factors and inverse aside."""
        for f in self.factors:
            self.schedules[f].serialize(serializer['schedule_' + f])

    def serialize(self, serializer):
        """Saves or loads the factors, inverses and refresh state."""
        for f in self.factors:
            self.factor[f] = self._serialize_array(
                serializer, f, self.factor[f])
        self.serialize_schedules(serializer)
        self.inverse_schedule.serialize(serializer['schedule_inverse'])
        self._factors_changed = bool(
            serializer('factors_changed', self._factors_changed))
        self.form = self._serialize_inverse(serializer)
        self._serialize_pending(serializer)

    def _serialize_inverse(self, serializer):
        """The current form: its kind and damping alone where it was built
        from the factors as they are (no factor changed since, none on its
        way), rebuilt from them at load (:meth:`Family.rebuild
        <chainerkfac.curvature.families.Family.rebuild>`); its arrays
        otherwise."""
        loading = isinstance(serializer, serializer_module.Deserializer)
        form = None if loading else self.form
        rebuilt = -1
        if form is not None and not self._factors_changed and \
                self.pending is None and self.family.rebuilds(form) and \
                all(self.factor[f] is not None for f in self.factors):
            rebuilt = self.family.kinds.index(type(form))
        rebuilt = int(serializer('inverse_rebuilt', rebuilt))
        if rebuilt < 0:
            return self._serialize_form(serializer, 'inverse_', form)
        damping = float(serializer('damping_used', -1.0 if form is None
                                   else form.damping))
        if not loading:
            return form
        return self.family.rebuild(
            self.family.kinds[rebuilt],
            tuple(self.factor[f] for f in self.factors), damping)

    def _serialize_form(self, serializer, prefix, form):
        """Saves ``form`` under keys starting with ``prefix`` (its arrays
        and damping), or returns the form loaded from them."""
        arrays = {} if form is None else form.arrays
        loaded = {}
        for key in families.snapshot_keys(self.family.kinds):
            value = self._serialize_array(serializer, prefix + key,
                                          arrays.get(key))
            if value is not None:
                loaded[key] = value
        # The current form's damping keeps the key snapshots always had.
        damping_key = 'damping_used' if prefix == 'inverse_' \
            else prefix + 'damping'
        used = serializer(damping_key, -1.0 if form is None
                          else form.damping)
        if not isinstance(serializer, serializer_module.Deserializer):
            return form
        return families.restore(self.family.kinds, loaded,
                                None if float(used) < 0 else float(used))

    def _serialize_pending(self, serializer):
        """The inverse built in the background and the step it takes
        effect at: a snapshot waits for it and keeps it, so that the
        resumed run puts it in place at the same step."""
        loading = isinstance(serializer, serializer_module.Deserializer)
        if not loading and self.pending is not None:
            self.pending = self.pending[0], background.result(self.pending[1])
        at = int(serializer('pending_step', -1 if self.pending is None
                            else self.pending[0]))
        if loading and at < 0:
            self.pending = None
            return
        form = self._serialize_form(
            serializer, 'pending_', self.pending and self.pending[1])
        if loading:
            self.pending = at, form


def _present_key(key):
    """The entry that says whether array ``key`` of a block is stored, and
    how (:data:`ABSENT`, :data:`FULL`, :data:`SYMMETRIC`, :data:`LOWER`)."""
    return key + '@present'


#: How an array is stored: not at all, whole, as the upper triangle of a
#: symmetric matrix (the factors, explicit inverses), or as the lower
#: triangle of a lower-triangular one (Cholesky factors); the triangles of
#: an array in Fortran order (LAPACK's results) load in that order, in
#: which the products that read it round as before. The triangles halve
#: a snapshot's curvature and give back the same bits.
ABSENT, FULL, SYMMETRIC, LOWER, SYMMETRIC_F, LOWER_F = range(6)


def _layout(value):
    """The layout a square matrix that is exactly symmetric or lower
    triangular is stored in; :data:`FULL` for any other array."""
    value = backend.CpuDevice().send(value)
    if value.ndim != 2 or value.shape[0] != value.shape[1] or \
            value.shape[0] < 2:
        return FULL
    fortran = not value.flags.c_contiguous and value.flags.f_contiguous
    if (value == value.T).all():
        return SYMMETRIC_F if fortran else SYMMETRIC
    if not numpy.triu(value, 1).any():
        return LOWER_F if fortran else LOWER
    return FULL


def _packed(value, layout):
    if layout == FULL:
        return value
    value = backend.CpuDevice().send(value)
    rows, cols = (numpy.triu_indices if layout in (SYMMETRIC, SYMMETRIC_F)
                  else numpy.tril_indices)(len(value))
    return value[rows, cols]


def unpack(stored, layout):
    """The array a snapshot holds as ``stored`` in ``layout`` (the value
    of its ``@present`` entry)."""
    if layout == FULL:
        return stored
    # n (n + 1) / 2 entries: n from the quadratic formula.
    n = int(round((numpy.sqrt(8 * stored.size + 1) - 1) / 2))
    symmetric = layout in (SYMMETRIC, SYMMETRIC_F)
    full = numpy.zeros((n, n), dtype=stored.dtype,
                       order='F' if layout in (SYMMETRIC_F, LOWER_F) else 'C')
    rows, cols = (numpy.triu_indices if symmetric else numpy.tril_indices)(n)
    full[rows, cols] = stored
    if symmetric:
        full[cols, rows] = stored
    return full
