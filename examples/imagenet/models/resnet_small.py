"""A small ResNet for quick runs on 32x32 or 64x64 images.

Three stages of one basic residual block each (16, 32, 64 channels, strides
1, 2, 2) after a 3x3 stem, then global average pooling and a Linear
classifier: about 80 thousand parameters, the same link types as ResNet-50
(Convolution2D, BatchNormalization, Linear) and so the same K-FAC blocks.
"""
import chainer
import chainer.functions as F
import chainer.links as L

from .conv_bn import ConvBN


class BasicBlock(chainer.Chain):
    """3x3 -> 3x3 residual block, 1x1 projection shortcut when needed."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        with self.init_scope():
            self.cb1 = ConvBN(in_channels, out_channels, 3, stride)
            self.cb2 = ConvBN(out_channels, out_channels, 3)
            if stride != 1 or in_channels != out_channels:
                self.shortcut = ConvBN(in_channels, out_channels, 1, stride)

    def forward(self, x):
        h = self.cb2(F.relu(self.cb1(x)))
        if hasattr(self, 'shortcut'):
            x = self.shortcut(x)
        return F.relu(h + x)


class ResNetSmall(chainer.Chain):
    """Small ResNet returning class scores (logits).

    Args:
        n_classes (int): Number of output classes.
        stem (int): Channels of the 3x3 stem.
        stages: ``(channels, stride)`` of each stage's basic block.
    """

    def __init__(self, n_classes=10, stem=16,
                 stages=((16, 1), (32, 2), (64, 2))):
        super().__init__()
        widths = [stem] + [channels for channels, _ in stages]
        with self.init_scope():
            self.stem = ConvBN(3, stem, 3)
            self.stages = chainer.ChainList(*[
                BasicBlock(c_in, c_out, stride) for c_in, (c_out, stride)
                in zip(widths, stages)])
            self.fc = L.Linear(widths[-1], n_classes)

    def forward(self, x):
        h = F.relu(self.stem(x))
        for block in self.stages:
            h = block(h)
        return self.fc(F.average(h, axis=(2, 3)))
