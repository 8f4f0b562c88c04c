"""A snapshot taken in memory and loaded into a fresh model and optimizer,
as a resumed run would."""
import chainer


def reloaded(model, optimizer, make):
    """Saves ``model`` and ``optimizer``, builds new ones with ``make()``
    (which returns ``(model, optimizer)``, the optimizer set up) and loads
    the saved state into them."""
    state, weights = {}, {}
    chainer.serializers.DictionarySerializer(state).save(optimizer)
    chainer.serializers.DictionarySerializer(weights).save(model)
    model, optimizer = make()
    chainer.serializers.NpzDeserializer(weights).load(model)
    chainer.serializers.NpzDeserializer(state).load(optimizer)
    return model, optimizer
