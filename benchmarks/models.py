"""The benchmark models: ResNet-50 at any width, a small CNN and an MLP.

Every model maps ``x`` to class scores and is built from Convolution2D,
BatchNormalization and Linear links only, so K-FAC has a block for every
parameterised link. ``MODELS[name]`` gives ``(factory, input shape, number of
classes)``; the factory takes a ``width_divisor`` where it makes sense.

ResNet-50 is defined here rather than imported from the ImageNet example so
that every channel count can be divided by an integer (``resnet50_w4``: the
flop ratios of the full model at 1/64 of the cost when the input side is
halved too).
"""
import os
import sys

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.functions as F
import chainer.links as L

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..', 'examples'))
from imagenet.models import resnet_small  # NOQA: E402
from imagenet.models.conv_bn import ConvBN  # NOQA: E402

#: (in, mid, out channels, blocks, stride) of ResNet-50's bottleneck stages.
RESNET50_STAGES = ((64, 64, 256, 3, 1), (256, 128, 512, 4, 2),
                   (512, 256, 1024, 6, 2), (1024, 512, 2048, 3, 2))


class Bottleneck(chainer.Chain):
    """1x1 -> 3x3 -> 1x1 residual block; stride on the first 1x1 conv."""

    def __init__(self, in_channels, mid_channels, out_channels, stride):
        super().__init__()
        with self.init_scope():
            self.cb1 = ConvBN(in_channels, mid_channels, 1, stride)
            self.cb2 = ConvBN(mid_channels, mid_channels, 3)
            self.cb3 = ConvBN(mid_channels, out_channels, 1)
            if stride != 1 or in_channels != out_channels:
                self.shortcut = ConvBN(in_channels, out_channels, 1, stride)

    def forward(self, x):
        h = F.relu(self.cb1(x))
        h = F.relu(self.cb2(h))
        h = self.cb3(h)
        if hasattr(self, 'shortcut'):
            x = self.shortcut(x)
        return F.relu(h + x)


class ResNet50(chainer.Chain):
    """ResNet-50 (7x7 stem, 16 bottlenecks, global average pooling, FC).

    Args:
        n_classes (int): Output classes.
        width_divisor (int): Every channel count is divided by it (the
            input's 3 channels excepted).
    """

    def __init__(self, n_classes=1000, width_divisor=1):
        super().__init__()
        w = width_divisor
        with self.init_scope():
            self.stem = ConvBN(3, 64 // w, 7, 2)
            self.stages = chainer.ChainList(*[
                chainer.ChainList(*[
                    Bottleneck((in_ch if i == 0 else out) // w, mid // w,
                               out // w, stride if i == 0 else 1)
                    for i in range(n_blocks)])
                for in_ch, mid, out, n_blocks, stride in RESNET50_STAGES])
            self.fc = L.Linear(RESNET50_STAGES[-1][2] // w, n_classes)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = F.max_pooling_2d(h, 3, stride=2, pad=1, cover_all=False)
        for stage in self.stages:
            for block in stage:
                h = block(h)
        return self.fc(F.average(h, axis=(2, 3)))


def TinyResNet(n_classes=10):
    """The ImageNet example's small ResNet, narrowed: an 8-channel 3x3 stem
    and one basic block per width (16, 32), each halving the side; global
    average pooling and a linear classifier (all convolutions with
    BatchNorm). At 24x24: 7 convolutions, 19k weights, about 1 ms per image
    for a training step on one CPU thread."""
    return resnet_small.ResNetSmall(n_classes, stem=8,
                                    stages=((16, 2), (32, 2)))


class SmallCNN(chainer.Chain):
    """Three conv-BN-ReLU layers (3x3; strides 1, 2, 2), pooling and FC.

    Widths (64, 128, 256); at 32x32 and batch 128 a MomentumSGD step takes
    about 0.56 s on this project's 2-core CPU (PyTorch 2.13 on the same
    CPU: 0.10 s for the same shapes).
    """

    def __init__(self, n_classes=10, in_channels=3, widths=(64, 128, 256)):
        super().__init__()
        c1, c2, c3 = widths
        with self.init_scope():
            self.conv1 = L.Convolution2D(in_channels, c1, 3, 1, 1,
                                         nobias=True)
            self.bn1 = L.BatchNormalization(c1)
            self.conv2 = L.Convolution2D(c1, c2, 3, 2, 1, nobias=True)
            self.bn2 = L.BatchNormalization(c2)
            self.conv3 = L.Convolution2D(c2, c3, 3, 2, 1, nobias=True)
            self.bn3 = L.BatchNormalization(c3)
            self.fc = L.Linear(c3, n_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = F.relu(self.bn3(self.conv3(h)))
        return self.fc(F.average(h, axis=(2, 3)))


class MLP(chainer.Chain):
    """784 -> 1024 -> 1024 -> 10 with ReLU (Linear blocks only)."""

    def __init__(self, n_in=784, n_hidden=1024, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, n_classes)

    def forward(self, x):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return self.l3(h)


class WideMLP(MLP):
    """784 -> 2048 -> 10 with ReLU: one dominant Kronecker block."""

    def __init__(self):
        chainer.Chain.__init__(self)
        with self.init_scope():
            self.l1 = L.Linear(784, 2048)
            self.l3 = L.Linear(2048, 10)

    def forward(self, x):
        return self.l3(F.relu(self.l1(x)))


class ChainerCIFARVGG(chainer.Chain):
    """Chainer's CIFAR example's VGG (``examples/cifar/models/VGG.py``):
    13 conv (3x3, no bias) + BatchNorm + ReLU layers of 64-512 channels in
    five stages with max-pooling and dropout, then
    ``Linear(None, 512, nobias=True)`` + BatchNorm + ReLU and
    ``Linear(None, 10, nobias=True)``."""

    STAGES = ((64, 2, 0.3), (128, 2, 0.4), (256, 3, 0.4), (512, 3, 0.4),
              (512, 3, 0.4))

    def __init__(self, n_classes=10):
        super().__init__()
        self.plan = []
        with self.init_scope():
            for s, (channels, n, drop) in enumerate(self.STAGES):
                for i in range(n):
                    name = 'block{}_{}'.format(s + 1, i + 1)
                    setattr(self, name + '_conv', L.Convolution2D(
                        None, channels, 3, pad=1, nobias=True))
                    setattr(self, name + '_bn', L.BatchNormalization(
                        channels))
                    self.plan.append((name, drop if i < n - 1 else None))
            self.fc1 = L.Linear(None, 512, nobias=True)
            self.bn_fc1 = L.BatchNormalization(512)
            self.fc2 = L.Linear(None, n_classes, nobias=True)

    def forward(self, x):
        h = x
        for name, drop in self.plan:
            h = F.relu(getattr(self, name + '_bn')(
                getattr(self, name + '_conv')(h)))
            if drop is None:
                h = F.max_pooling_2d(h, 2, 2)
            else:
                h = F.dropout(h, drop)
        h = F.dropout(h, 0.5)
        h = F.dropout(F.relu(self.bn_fc1(self.fc1(h))), 0.5)
        return self.fc2(h)


#: name -> (factory, input shape of one sample, number of classes)
MODELS = {
    'resnet50': (lambda: ResNet50(1000), (3, 224, 224), 1000),
    'resnet50_w4': (lambda: ResNet50(1000, width_divisor=4), (3, 112, 112),
                    1000),
    'resnet50_w4_32': (lambda: ResNet50(10, width_divisor=4), (3, 32, 32),
                       10),
    'small_cnn': (lambda: SmallCNN(10), (3, 32, 32), 10),
    'tiny_resnet': (lambda: TinyResNet(10), (3, 24, 24), 10),
    'mlp': (lambda: MLP(), (784,), 10),
    # One block (l1: A 785, G 2048) holds almost all the curvature work.
    'wide_mlp': (lambda: WideMLP(), (784,), 10),
    # Chainer's MNIST example (examples/mnist/train_mnist.py, --unit 1000):
    # L.Linear(None, 1000) twice with ReLU, then L.Linear(None, 10).
    'chainer_mnist_mlp': (lambda: MLP(n_in=None, n_hidden=1000), (784,),
                          10),
    'chainer_cifar_vgg': (lambda: ChainerCIFARVGG(), (3, 32, 32), 10),
}

#: Default batch per model (the issue's: 32 for ResNet-50, 128 otherwise).
DEFAULT_BATCH = {'resnet50': 32, 'resnet50_w4': 32, 'resnet50_w4_32': 16,
                 'small_cnn': 128, 'tiny_resnet': 128,
                 'mlp': 128, 'wide_mlp': 128,
                 # Chainer's examples' own batches.
                 'chainer_mnist_mlp': 100, 'chainer_cifar_vgg': 64}

DESCRIPTIONS = {
    'resnet50': 'ResNet-50, 224x224',
    'resnet50_w4': 'ResNet-50 width/4, 112x112',
    'resnet50_w4_32': 'ResNet-50 width/4, 32x32, 10 classes',
    'small_cnn': 'small CNN (3 conv+BN, FC), 32x32',
    'tiny_resnet': 'tiny ResNet (stem + 2 basic blocks, BN), 24x24',
    'mlp': 'MLP 784-1024-1024-10',
    'chainer_mnist_mlp': "Chainer's MNIST example, MLP 784-1000-1000-10",
    'chainer_cifar_vgg': "Chainer's CIFAR example, VGG (13 conv+BN), 32x32",
    'wide_mlp': 'MLP 784-2048-10',
}
