#!/bin/bash
# Batch-1 cost and round split, before (2a99bc8) / after (main), alone on the machine, 2 threads.
set -e
source /work/main/.venv/bin/activate
OUT=/work/main/docs/benchmarks/2026-12-01/round-loop-quiet
mkdir -p $OUT
for i in 1 2; do
  (cd /work/before && PYTHONPATH=/work/before python decode/batch_overhead.py threads=2) > $OUT/batch_overhead-before-$i.txt 2>&1
  (cd /work/main && PYTHONPATH=/work/main python decode/batch_overhead.py threads=2) > $OUT/batch_overhead-after-$i.txt 2>&1
done
(cd /work/before && PYTHONPATH=/work/before python decode/time_split.py --threads 2) > $OUT/time_split-before.txt 2>&1
(cd /work/main && PYTHONPATH=/work/main python decode/time_split.py --threads 2) > $OUT/time_split-after.txt 2>&1
uptime >> $OUT/time_split-after.txt
echo done
