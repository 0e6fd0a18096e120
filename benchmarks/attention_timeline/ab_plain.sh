#!/bin/bash
# Times the FP8 forward of two kernels/cuda trees in turns, torch-free:
#   bash benchmarks/attention_timeline/ab_plain.sh OLD_KERNELS_DIR NEW_KERNELS_DIR [ROUNDS]
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
NVCC=$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)")/bin/nvcc
F="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a"
for v in old new; do
  src=$1; [ $v = new ] && src=$2
  rm -rf /tmp/ab_$v && mkdir -p /tmp/ab_$v && cp "$src"/*.cu "$src"/*.cuh "$src"/*.h /tmp/ab_$v/ && cp $HERE/harness.cu /tmp/ab_$v/
  (cd /tmp/ab_$v && $NVCC $F harness.cu -o h) &
done
wait
for round in $(seq ${3:-2}); do
  for shape in "4 16 16 4096 128 1" "4 16 4 4096 128 1" "4 16 16 4096 64 1" "16 16 16 1024 64 1" "4 16 16 4096 128 0" "16 16 16 1024 128 1"; do
    for v in old new; do echo -n "[$v] "; /tmp/ab_$v/h $shape 1; done
  done
done
