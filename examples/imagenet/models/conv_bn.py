"""The convolution + BatchNormalization unit every model here is built from."""
import chainer
import chainer.links as L
from chainer import initializers


class ConvBN(chainer.Chain):
    """Bias-free convolution with 'same' padding, then BatchNormalization.

    The convolution has no bias because the BatchNormalization's beta plays
    its role; its weights are He-normal (variance 2 / fan-in), which also
    puts their norm near the sqrt(2 d_out) that weight rescaling targets.
    """

    def __init__(self, in_channels, out_channels, ksize, stride=1):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(
                in_channels, out_channels, ksize, stride, ksize // 2,
                nobias=True, initialW=initializers.HeNormal())
            self.bn = L.BatchNormalization(out_channels)

    def forward(self, x):
        return self.bn(self.conv(x))
