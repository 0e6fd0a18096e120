#!/usr/bin/env bash
# Two source trees side by side on one machine, taking turns round by round (the
# GPU machine's host drifts in speed faster than one run; turns make the drift touch
# both alike):
#   bash benchmarks/ab_gpu.sh OLD NEW ROUNDS script.py [args ...]
# Each tree imports its own te_fuser (PYTHONPATH, with a te_fuser/kernels link to
# its kernels/ folder, as the editable install maps it) and builds its CUDA
# extension in its own folder, so neither rebuilds the other's. Each output line
# starts with the tree's folder name.
set -uo pipefail
old=$(cd "$1" && pwd) new=$(cd "$2" && pwd) rounds=$3
shift 3
for tree in "$old" "$new"; do
  [ -e "$tree/te_fuser/kernels" ] || ln -s ../kernels "$tree/te_fuser/kernels"
done
for round in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    name=$(basename "$tree")
    echo "== round $round: $name"
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" TORCH_EXTENSIONS_DIR="$tree/.ext" python3 "$@" 2>&1) \
      | sed "s|^|[$name] |"
  done
done
