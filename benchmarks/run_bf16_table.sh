#!/usr/bin/env bash
# The bf16 table of issue 36: finetune_quality.py --dtype bf16, one process per (direction, lr,
# seed), each writing benchmarks/results/bf16/<direction>_<lr>_s<seed>[_<tag>].json;
# benchmarks/bf16_table.py combines whatever files are there into the table.
#
#   benchmarks/run_bf16_table.sh DIRECTION LR SEED TAG SYSTEM...
#     DIRECTION  shakespeare-to-bbc | bbc-to-shakespeare
#     LR         bench (the benchmark's 5e-4) | ulp0.1 (a tenth of a bf16 ulp of the median weight)
#     TAG        a name for this set of systems (file names differ by it)
#
# Runs at nice 5 on one thread (the machine is shared). Example:
#   benchmarks/run_bf16_table.sh shakespeare-to-bbc bench 0 today OffloadAdamW "moments, U=4"
set -euo pipefail
cd "$(dirname "$0")/.."
direction=$1 lr=$2 seed=$3 tag=$4
shift 4
case $lr in
  bench) lr_args=() ;;
  ulp0.1) lr_args=(--lr-ulp 0.1) ;;
  *) echo "LR must be bench or ulp0.1" >&2; exit 2 ;;
esac
python=${PYTHON:-/work/main/.venv/bin/python}
PYTHONPATH=$PWD OMP_NUM_THREADS=1 exec nice -n 5 "$python" benchmarks/finetune_quality.py \
  --dtype bf16 --direction "$direction" "${lr_args[@]}" --seeds "$seed" \
  --out benchmarks/results/bf16 --name "${direction}_${lr}_s${seed}_${tag}" --systems "$@"
