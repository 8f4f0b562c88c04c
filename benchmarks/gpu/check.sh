#!/usr/bin/env bash
# The GPU checks: CuPy + NCCL paths, GPU against CPU numbers, ResNet-50 step
# time and memory, and the ImageNet example, on one CUDA machine.
#
#     benchmarks/gpu/check.sh OUT_DIR [STAGE ...]
#
# Stages (all by default): setup probe tests step_time inverse_delay peer
# mpi imagenet. Each writes OUT_DIR/STAGE.log; a failing stage does not stop
# the others.
#
# The machine provides Python 3.12 with CuPy 14 (CUDA 13, NCCL), NumPy 2 and
# SciPy; what it lacks comes as wheels in .whl/ (Chainer 7.8.1, mpich,
# mpi4py, setuptools<81, and kfac-pytorch for the peer stage; prepared with
# `pip download`/`pip wheel`, see docs/gpu.md). setup makes a virtual environment on top of that Python's
# packages and installs chainerkfac into it, .pth start-up hook included.
set -u
OUT=$(realpath -m "${1:?usage: check.sh OUT_DIR [STAGE ...]}")
shift
STAGES=${*:-setup probe tests step_time inverse_delay peer mpi imagenet}
# Not run by default: ab, an A/B of statistics layouts (benchmarks/patches.py);
# tf32, the step times with CuPy's matrix products in TF32 (CUPY_TF32=1).
VENV=${GPU_VENV:-/tmp/chainerkfac-gpu}
PY=$VENV/bin/python
BASE=${GPU_PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

setup() {
    # --system-site-packages sees the base interpreter's packages only; the
    # .pth adds those of the Python we were given (itself often a venv).
    "$BASE" -m venv --system-site-packages "$VENV" &&
    "$BASE" -c 'import site; print("\n".join(site.getsitepackages()))' \
        > "$("$PY" -c 'import site; print(site.getsitepackages()[0])')/base.pth" &&
    "$PY" -m pip install -q --no-index --no-deps .whl/*.whl &&
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation . &&
    rm -rf build &&
    "$PY" -m pip list 2>/dev/null | grep -iE \
        '^(chainer|chainerkfac|cupy|numpy|scipy|mpi4py|mpich|setuptools) '
}

probe() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" - <<'PY'
import chainerkfac, chainer, cupy, numpy
from chainer.backends import cuda
from cupy.cuda import nccl
print('chainer', chainer.__version__, 'cupy', cupy.__version__,
      'numpy', numpy.__version__, 'cuda available', cuda.available,
      'cudnn', cuda.cudnn_enabled, 'nccl', nccl.get_version(),
      'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())
import chainer.links as L, chainer.functions as F
# One convolution's gradients on the GPU against the CPU's, float32.
rng = numpy.random.RandomState(0)
x = rng.randn(2, 3, 8, 8).astype(numpy.float32)
W = rng.randn(4, 3, 3, 3).astype(numpy.float32)
grads = []
for spec in ('@numpy', '@cupy:0'):
    link = L.Convolution2D(3, 4, 3, initialW=W)
    link.to_device(spec)
    link.cleargrads()  # a new Parameter's gradient is NaN-filled
    F.sum(link(link.device.send(x)) ** 2).backward()
    grads.append(chainer.backend.CpuDevice().send(link.W.grad))
print('conv W gradient, GPU vs CPU: largest relative difference %.2e, '
      'finite on GPU: %s' % (abs(grads[1] - grads[0]).max()
                             / abs(grads[0]).max(),
                             bool(numpy.isfinite(grads[1]).all())))
print('its norm: cupy.linalg.norm %.6g, numpy.linalg.norm %.6g' % (
    float(cupy.linalg.norm(cupy.asarray(grads[1]))),
    numpy.linalg.norm(grads[1])))
PY
}

tests() {
    # Every test file that honours --device (tests/device.py).
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider --device=@cupy:0 \
        $(grep -lE '^from tests(.device)? import (device|host|place|send)' \
          tests/test_*.py)
}

mpi() {
    local s=tests/mpi_scripts/kfac_equivalence.py d=$OUT/mpi
    mkdir -p "$d"
    export PYTHONPATH=.
    for variant in "" "--batch-norm" "--inverse eigen"; do
        local tag=${variant//[- ]/}; tag=${tag:-plain}
        echo "== $tag: one CPU process, then pure_nccl with 1 rank on GPU 0"
        "$PY" $s "$d/cpu_$tag.npz" --single $variant &&
        timeout 300 "$VENV/bin/mpiexec" -n 1 "$PY" $s "$d/gpu_$tag.npz" \
            $variant --device @cupy:0 --communicator pure_nccl &&
        "$PY" - "$d/cpu_$tag.npz" "$d/gpu_$tag.npz" <<'PY'
import sys, numpy
a, b = (numpy.load(p) for p in sys.argv[1:])
worst = max(float(abs(a[k] - b[k]).max() / abs(a[k]).max()) for k in a.files)
print('largest difference GPU vs CPU, relative to each array max: %.2e'
      % worst)
assert worst < 1e-9, worst
PY
    done
    echo "== pure_nccl, 2 ranks sharing GPU 0 (NCCL needs a GPU per rank)"
    timeout 120 "$VENV/bin/mpiexec" -n 2 "$PY" $s "$d/gpu2.npz" \
        --device @cupy:0 --communicator pure_nccl
    echo "exit status $?"
}

step_time() {
    timeout 300 "$PY" benchmarks/step_time.py --models resnet50 \
        --device @cupy:0 \
        --configs sgd,kfac_1,kfac_10_100,kfac_50_50,kfac_adaptive \
        --steps ${GPU_STEPS:-30} --warmup 3 --out "$OUT/step_time_gpu.json"
    echo "== per-stage breakdown: the GPU is synchronised at every stage"
    timeout 200 "$PY" benchmarks/step_time.py --models resnet50 \
        --device @cupy:0 --sync-stages --configs sgd,kfac_1,kfac_10_100 \
        --steps 10 --warmup 2 --out "$OUT/step_time_gpu.json" --name stages
}

inverse_delay() {
    # Each step's time through refresh intervals, inverses built at once
    # (d = 0) or on their own stream and used 3 steps later (d = 3).
    timeout 200 "$PY" benchmarks/step_time.py --models resnet50 \
        --device @cupy:0 --configs \
        sgd,kfac_10_20,kfac_10_20_delay3,kfac_adaptive,kfac_adaptive_delay3 \
        --steps 40 --warmup 3 --out "$OUT/step_time_gpu.json" \
        --name inverse_delay
}

peer() {
    timeout 200 "$PY" benchmarks/gpu/peer_torch.py --steps 40 \
        --out "$OUT/peer_torch.json"
}

ab() {
    timeout 300 "$PY" benchmarks/step_time.py --models resnet50 \
        --device @cupy:0 --sync-stages --configs \
        sgd,kfac_1,kfac_1+im2col,kfac_1+whole_batch,kfac_1+im2col_whole_batch \
        --steps 12 --warmup 2 --out "$OUT/step_time_gpu.json" --name ab
}

tf32() {
    CUPY_TF32=1 timeout 300 "$PY" benchmarks/step_time.py --models resnet50 \
        --device @cupy:0 --configs sgd,kfac_1,kfac_10_100,kfac_50_50 \
        --steps 30 --warmup 3 --out "$OUT/step_time_gpu.json" --name tf32
}

imagenet() {
    local data=/tmp/chainerkfac-digits
    "$PY" examples/imagenet/prepare.py digits $data &&
    timeout 500 "$VENV/bin/mpiexec" -n 1 "$PY" examples/imagenet/train.py \
        $data/train.txt $data/val.txt --config \
        examples/imagenet/configs/small.json --batchsize 64 \
        --iterations ${GPU_ITERATIONS:-300} --device gpu \
        --out "$OUT/imagenet" &&
    tail -n 40 "$OUT/imagenet/log"
}

for stage in $STAGES; do
    echo "### $stage" | tee "$OUT/$stage.log"
    start=$(date +%s)
    ( $stage ) >> "$OUT/$stage.log" 2>&1
    status=$?
    echo "### $stage: exit $status in $(( $(date +%s) - start )) s" | \
        tee -a "$OUT/$stage.log"
    tail -n 25 "$OUT/$stage.log"
done
