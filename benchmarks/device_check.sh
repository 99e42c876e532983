#!/usr/bin/env bash
# The CUDA checks, prepared for a session lent a GPU machine (the `device` tool's `run`), as
# one short script: the machine's image has python3 with a CUDA torch, transformers, xxhash,
# rich, prometheus-client, matplotlib, pytest and hypothesis; it has no network, no Mooncake
# (pool tests skip) and no vLLM (its wheel is over the 64 MiB a run may carry).
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=600)
#
# Writes under $OUT (what comes back): the environment, the CUDA-path tests, calibrate's
# pinned/pageable H2D and D2H GB/s (against the PCIe ceiling in `kvstrata hardware links`),
# validate's predicted vs measured restores, bench cache's device/host/disk ratios, and bench
# cache --tp-readers: head-sliced vs TP-matched restores into the GPU at reader TP 1, 2, 4, 8 (all
# ranks on the one GPU, one after another) and the TP=8 / TP=1 instance lookup.
set -uo pipefail
OUT=${OUT:-/tmp/kvstrata-device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
step() { echo "== $1 ($(date +%T))"; }

step environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); print('transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step "tests on CUDA (tiers, transfer worker, manager, cache, transformers integration)"
timeout 240 "$PY" -m pytest -q -x -p no:cacheprovider tests/tiers tests/transfer tests/manager tests/test_cache.py tests/test_cache_cancel.py \
  tests/integrations/test_hf.py tests/integrations/test_recompute.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$?" | tee -a "$OUT/tests.txt"; tail -3 "$OUT/tests.txt"

step "calibrate (pinned / pageable H2D, D2H vs the PCIe ceiling)"
timeout 120 "$PY" -m kvstrata calibrate --quick --out "$OUT/host.toml" --json > "$OUT/calibrate.json" 2> "$OUT/calibrate.err"
echo "calibrate rc=$?"
"$PY" -m kvstrata hardware links > "$OUT/links.txt" 2>&1

step "validate (restores through the cache vs the calibrated prediction)"
timeout 90 "$PY" -m kvstrata validate --profile "$OUT/host.toml" --json > "$OUT/validate.json" 2> "$OUT/validate.err"
echo "validate rc=$?"

step "bench cache (device tier on CUDA: pinned copies, per-thread streams)"
timeout 150 "$PY" -m kvstrata bench cache --size-mib 1024 --no-lmcache --json > "$OUT/bench_cache.json" 2> "$OUT/bench_cache.err"
echo "bench cache rc=$?"

step "bench cache --tp-readers (head-sliced vs TP-matched restores into CUDA, TP 1/2/4/8)"
timeout 150 "$PY" -m kvstrata bench cache --size-mib 256 --repeats 3 --no-lmcache --tp-readers 1,2,4,8 --json \
  > "$OUT/bench_tp_readers.json" 2> "$OUT/bench_tp_readers.err"
echo "bench cache --tp-readers rc=$?"
step done
