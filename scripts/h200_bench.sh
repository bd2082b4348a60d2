#!/bin/sh
# Conversion throughput on the lent 16-core H200 host (docs/BENCHMARKS.md), in two phases that each
# fit one 10-minute device call: `gptq` (build a GPTQ checkpoint, the worker-count table for triton,
# every backend at the default worker count), `scaling` (worker counts for a
# transcoded and a canonical-route backend), `awq` (the same for an AWQ source), `scaling7` (the
# worker-count table and every backend on that 7 GB source), `awq7` (a 7 GB AWQ source on three backends,
# then verify's structure and lossless levels timed on its triton output), `builds` (commits compared), `final` (7 GB GPTQ and AWQ, every backend, verify, fixed cost), `final2` (the same,
# each output verified, AWQ -> cpu too), `large` (a 25 GB source grown from one layer),
# `final3` (grown 7 GB sources, verify's worker scaling, the 25 GB source), `final4` (grown 7 GB GPTQ and
# AWQ sources on every backend, each output verified), `large4` (the 25 GB source with the tree's memory
# split by process, benchmarks/tree_memory.py), `gil5` (two builds A/B, their outputs verified), `probe6` (where the 25 GB humming verify's time goes),
# `groups6` (two builds A/B at 25 GB), `numpy7` (96899ed against the numpy checks' build at 7.2 GB, verified),
# `large7` (the same two builds at 25 GB), `awq7n` (the grown 7.2 GB AWQ source on every backend, verified,
# then the fixed cost), `cpu7` (the cpu layout's numpy checks and two rounds of the per-linear backends, 7.2 GB AWQ
# and GPTQ), `prep8` (cd0a9f0 against the build whose verify prepares with the collector paused and compares JSON
# files by their serializations: 7.2 GB into the per-linear layouts, then 25 GB into humming), `final10` (main
# after the packed form: grown 7.2 GB GPTQ and AWQ into every backend, verified), `large10` (the same build, the
# 25 GB GPTQ source into triton, humming and compressed-tensors, verified), `anchor11` and `anchor11-large`
# (issue 42's provenance cost: the grown 7.2 GB GPTQ source into three backends, then the 25 GB one into
# triton, each converted and verified as a plain folder and then as a Hub cache snapshot), `gpu49` (the GPU tests,
# then every float fixture converted and verified on the GPU), `gpu51` (the float fixtures into the triton backend's
# stacked float layouts, verified on the GPU).
set -e
phase=$1
out=${OUT:-/tmp}
export PYTHONPATH=$PWD
nproc; free -g | head -2; df -h . | tail -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
grown() {  # $1: gptq or awq, $2: layers -> bench-data/$1-$2L, grown from one synthetic layer
  python3 benchmarks/bench_convert.py --size-gb 0.3 --format $1 --backends triton --repeats 1 \
    --json "$out/one-layer-$1.json" > /dev/null
  python3 benchmarks/grow_checkpoint.py bench-data/qwen3-like-$1-1L-128E-2048H bench-data/$1-$2L --layers $2
  rm -rf bench-data/qwen3-like-$1-1L-128E-2048H
}
verified() {  # $1: gptq or awq, $2: layers, $3: backends, $4: repeats, $5: json -> bench_convert.py on the grown source, verified
  grown $1 $2
  sync
  python3 benchmarks/bench_convert.py --source bench-data/$1-$2L --format $1 --backends $3 --repeats $4 --verify \
    --json "$out/$5"
  rm -rf bench-data/$1-$2L
}
case $phase in
  gpu49)
    # The GPU tests (the compiled int and FP4 reference kernels against float64), then every float fixture that
    # converts (compressed-tensors NVFP4/MXFP4, W4A16 and W4A4, MXFP4 beside FP8-block dense layers) into the
    # compressed-tensors form and verified with verify's GPU default (the FP4 kernel on every layer and expert).
    python3 -m pip install -q --no-deps .whl/*.whl
    python3 -m compileall -q moeconv
    nvidia-smi --query-gpu=name,memory.total --format=csv
    timeout 300 python3 -m pytest -q -ra -p no:cacheprovider tests/test_fp4_kernel_gpu.py tests/test_kernel_gpu.py \
      2>&1 | tail -15 | tee "$out/gpu-tests.txt"
    for fixture in ct-nvfp4a16 ct-mxfp4a16 ct-nvfp4 ct-mxfp4-fp8block; do
      python3 -m moeconv convert tests/data/float/$fixture -o /tmp/out-$fixture --backend compressed-tensors -q > /dev/null
      rc=0; python3 -m moeconv verify /tmp/out-$fixture --json > "$out/verify-$fixture.json" || rc=$?
      echo "$fixture: verify rc=$rc $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['ok'], r['level'], r['numerics_device'], [(l['module'], l.get('experts_routed'), l.get('relative_error')) for l in r['layers']])" "$out/verify-$fixture.json")"
    done
    # Humming's FP4 schema (the MXFP4 fixture): its own words and scale bytes through the FP4 kernel on the GPU
    python3 -m moeconv convert tests/data/float/ct-mxfp4a16 -o /tmp/out-humming --backend humming -q > /dev/null
    rc=0; python3 -m moeconv verify /tmp/out-humming --json > "$out/verify-humming.json" || rc=$?
    echo "ct-mxfp4a16 -> humming: verify rc=$rc $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['ok'], r['numerics_device'], [(l['module'], l.get('relative_error')) for l in r['layers']])" "$out/verify-humming.json")" ;;
  gpu51)
    # The triton backend's stacked float layouts (issue 40): every float fixture that converts into them, verified
    # with verify's GPU default (the compiled FP4 kernel on the stacked bytes, every layer and expert).
    python3 -m pip install -q --no-deps .whl/*.whl
    nvidia-smi --query-gpu=name,memory.total --format=csv
    timeout 300 python3 -m pytest -q -ra -p no:cacheprovider tests/test_fp4_kernel_gpu.py 2>&1 | tail -5 | tee "$out/gpu-tests.txt"
    for fixture in ct-nvfp4a16 ct-mxfp4a16 ct-nvfp4 ct-mxfp4-fp8block; do
      python3 -m moeconv convert tests/data/float/$fixture -o /tmp/out-$fixture --backend triton -q > /dev/null
      rc=0; python3 -m moeconv verify /tmp/out-$fixture --json > "$out/verify-$fixture.json" || rc=$?
      echo "$fixture -> triton: verify rc=$rc $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['ok'], r['level'], r['numerics_device'], [(l['module'], l.get('experts_routed'), l.get('blocks_checked'), l.get('relative_error')) for l in r['layers']])" "$out/verify-$fixture.json")"
    done ;;
  final10|large10)
    # The blake3 and google-re2 wheels (cp312) in .whl carried: the image has neither.
    python3 -m pip install -q --no-deps .whl/*.whl
    python3 -m compileall -q moeconv
    if [ $phase = final10 ]; then
      for format in gptq awq; do
        verified $format 22 triton,compressed-tensors,humming,cpu 1 "${format}22.json"
      done
    else
      verified gptq 77 triton,humming,compressed-tensors 1 large.json
    fi ;;
  anchor11|anchor11-large)
    # What anchoring costs (issue 42): each source converted and verified first as a plain folder (unanchored),
    # then moved into a Hub cache layout (benchmarks/hub_cache.py --move: blobs named by their sha256) and
    # converted and verified from the snapshot, where both also check every file against its published sha256.
    # The blake3 and google-re2 wheels (cp312) in .whl carried: the image has neither. Disk: the source and one
    # of the copy or the output (bench_convert.py removes the other first): 50 GB at 25 GB.
    python3 -m pip install -q --no-deps .whl/*.whl
    python3 -m compileall -q moeconv
    if [ $phase = anchor11 ]; then layers=22 backends=triton,humming,compressed-tensors
    else layers=77 backends=triton; fi
    grown gptq $layers
    sync
    python3 benchmarks/bench_convert.py --source bench-data/gptq-${layers}L --format gptq --backends $backends \
      --repeats 1 --verify --json "$out/$phase-folder.json"
    snapshot=$(python3 benchmarks/hub_cache.py bench-data/gptq-${layers}L bench-data/hub --move)
    sync
    python3 benchmarks/bench_convert.py --source "$snapshot" --format gptq --backends $backends \
      --repeats 1 --verify --json "$out/$phase-hub.json"
    rm -rf bench-data/gptq-${layers}L bench-data/hub ;;
  digest9)
    # A/B: a7f7845 (sha256 block digests, manifest version 3) against 124f8b0 (BLAKE3, version 4), both
    # exported with `benchmarks/bench_builds.py export a7f7845 124f8b0` and .builds carried, the blake3 wheel
    # (cp312) in .whl carried: the grown 7.2 GB GPTQ source into three backends and the AWQ one into triton,
    # each output verified; CPU seconds per row.
    python3 -m pip install -q --no-deps .whl/blake3-*.whl
    python3 -m compileall -q moeconv .builds
    grown gptq 22
    sync
    python3 benchmarks/bench_builds.py run bench-data/gptq-22L --builds .builds --backends triton,compressed-tensors,humming \
      --repeats 1 --verify --json "$out/digest9-gptq.json" | tee "$out/digest9-gptq-rows.txt"
    rm -rf bench-data/gptq-22L
    grown awq 22
    sync
    python3 benchmarks/bench_builds.py run bench-data/awq-22L --builds .builds --backends triton,humming \
      --repeats 1 --verify --json "$out/digest9-awq.json" | tee "$out/digest9-awq-rows.txt"
    rm -rf bench-data/awq-22L ;;
  numpy7|large7)
    # A/B: 96899ed (the 12:28 build measured here) against the build whose verify checks in numpy with
    # workers that never import torch (exported with `benchmarks/bench_builds.py export 96899ed <commit>`,
    # .builds carried); numpy7: the GPTQ source grown to 22 layers (7.2 GB), three backends, two rounds;
    # large7: grown to 77 layers (25 GB), humming and triton, one round. Rows are printed as they come.
    python3 -m compileall -q moeconv .builds
    if [ $phase = numpy7 ]; then layers=22 backends=humming,compressed-tensors,triton repeats=2
    else layers=77 backends=humming,triton repeats=1; fi
    grown gptq $layers
    sync
    python3 benchmarks/bench_builds.py run bench-data/gptq-${layers}L --builds .builds --backends $backends \
      --repeats $repeats --verify --json "$out/$phase.json" | tee "$out/$phase-rows.txt"
    rm -rf bench-data/gptq-${layers}L ;;
  prep8)
    # A/B with .builds carried (`benchmarks/bench_builds.py export cd0a9f0 <commit>`): what verify spends before
    # its checks, on the outputs with the most tensors (humming: 1,170 a layer; compressed-tensors).
    python3 -m compileall -q moeconv .builds
    grown gptq 22
    sync
    python3 benchmarks/bench_builds.py run bench-data/gptq-22L --builds .builds --backends humming,compressed-tensors \
      --repeats 1 --verify --json "$out/prep7.json" | tee "$out/prep7-rows.txt"
    rm -rf bench-data/gptq-22L
    grown gptq 77
    sync
    python3 benchmarks/bench_builds.py run bench-data/gptq-77L --builds .builds --backends humming \
      --repeats 1 --verify --json "$out/prep25.json" | tee "$out/prep25-rows.txt"
    rm -rf bench-data/gptq-77L ;;
  cpu7)
    # verify of the cpu layout with its checks in numpy (workers without torch), from the grown 7.2 GB AWQ and
    # GPTQ sources; AWQ into compressed-tensors and humming again, two rounds each (whole process vs copy).
    python3 -m compileall -q moeconv
    verified awq 22 cpu,compressed-tensors,humming 2 awq22.json
    verified gptq 22 cpu 2 gptq22.json ;;
  awq7n)
    # The grown 7.2 GB AWQ source on every backend at the current build, each output verified, then the
    # fixed cost of a tiny conversion with and without bytecode.
    python3 -m compileall -q moeconv
    verified awq 22 triton,compressed-tensors,humming,cpu 1 awq22.json
    python3 benchmarks/bench_startup.py --repeats 3 --modes warm,no-pyc --json "$out/startup.json" ;;
  groups6)
    # A/B: 96899ed (the 13:05 build) against a newer one (d0db69c: small tensors' digests hashed in groups,
    # verify's digests begun before the plan, convert's jobs and verify's checks eight a task, the memory
    # sampler's bounded share), exported first with `benchmarks/bench_builds.py export 96899ed d0db69c` and
    # .builds carried; the grown GPTQ source into humming and triton, each output verified.
    python3 -m compileall -q moeconv .builds
    # $2: layers (77: 25 GB; the first two tries at 77 most likely filled the 64 GB disk: the copy beside the previous output)
    grown gptq ${2:-77}
    sync
    python3 benchmarks/bench_builds.py run bench-data/gptq-${2:-77}L --builds .builds \
      --backends ${3:-humming,triton} --repeats 1 --verify --json "$out/groups.json"
    rm -rf bench-data/gptq-${2:-77}L ;;
  probe6)
    # Where the 25 GB humming verify's time goes (1.55x its conversion at 13:05 UTC, digests 23 s, checks
    # 22 s, both superlinear against 7.2 GB): the disk's reads during each step (/sys/block), the tree's
    # CPU seconds, the parent's profile (py-spy, carried in .h200/bin), one memory sample's cost at 16 workers.
    python3 -m compileall -q moeconv
    grown gptq 77
    disk() { awk -v what="$1" '{printf "%s: %.2f GB read, %.2f GB written\n", what, $3*512/1e9, $7*512/1e9}' /sys/block/vda/stat; }
    cpu() { python3 -c 'import subprocess, sys, time, os
def busy():
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), fields[4] / os.sysconf("SC_CLK_TCK")
t, (b, w) = time.perf_counter(), busy(); rc = subprocess.call(sys.argv[1:]); b2, w2 = busy()
print(f"rc {rc} wall {time.perf_counter() - t:.2f} s, machine busy {b2 - b:.1f} CPU-s, iowait {w2 - w:.1f} s", file=sys.stderr)' "$@"; }
    disk before-convert
    cpu python3 -m moeconv convert bench-data/gptq-77L -o /tmp/hum --backend humming -q --json > "$out/convert.json"
    disk after-convert
    cpu python3 -m moeconv verify /tmp/hum --level lossless -q --json > "$out/verify1.json" || true
    disk after-verify1
    .h200/bin/py-spy record -r 100 -f raw -o "$out/verify-py-spy.txt" -- python3 -m moeconv verify /tmp/hum --level lossless -q --json > "$out/verify2.json" || true
    disk after-verify2
    grep -o '"phase_seconds": {[^}]*}' "$out/verify1.json" "$out/verify2.json" || true
    python3 -c '
import time
from moeconv.executor import Executor, pss_mb, descendants
with Executor(16) as pool:
    times = []
    for _ in range(10):
        t = time.perf_counter(); pool.memory.sample(); times.append(time.perf_counter() - t)
    below = descendants()
    t = time.perf_counter(); [pss_mb(pid) for pid in below]; one = (time.perf_counter() - t) / len(below)
    print(f"tree memory sample at 16 workers: {[round(x * 1e3, 1) for x in times]} ms; one process {one * 1e3:.2f} ms over {len(below)}")
'
    rm -rf /tmp/hum bench-data/gptq-77L ;;
  gil5)
    # A/B: 3bcfd73 (before) and 4a2edba (the hash pools' short GIL turns, 1fbf9a6, and the cheaper checks), exported to .builds
    # (benchmarks/bench_builds.py export, carried); the grown 7.2 GB GPTQ source into the per-linear layouts
    # and triton, each output verified, two rounds round-robin.
    python3 -m compileall -q moeconv .builds
    grown gptq 22
    python3 benchmarks/bench_builds.py run bench-data/gptq-22L --builds .builds \
      --backends humming,compressed-tensors,triton --repeats 2 --verify --json "$out/gil.json"
    rm -rf bench-data/gptq-22L ;;
  final4)
    # 2026-12-03 (evening): verify with its digests beside the checks, the faster unpack, and workers
    # forked from a frozen heap; every backend from grown 7.2 GB GPTQ and AWQ sources, each output verified.
    python3 -m compileall -q moeconv
    for format in gptq awq; do
      grown $format 22
      python3 benchmarks/bench_convert.py --source bench-data/$format-22L --format $format \
        --backends triton,compressed-tensors,humming,cpu --repeats 1 --verify --json "$out/${format}22.json"
      rm -rf bench-data/$format-22L
    done ;;
  large4)
    # The 25 GB source: GPTQ -> triton and humming verified, then one more triton conversion with the
    # tree's memory split by process (where the 1.9 GB of the afternoon's run was).
    python3 -m compileall -q moeconv
    grown gptq 77
    python3 benchmarks/bench_convert.py --source bench-data/gptq-77L --format gptq --backends triton,humming \
      --repeats 1 --verify --json "$out/large.json"
    rm -rf /tmp/large-out
    python3 benchmarks/tree_memory.py --json "$out/large-tree.json" -- \
      python3 -m moeconv convert bench-data/gptq-77L -o /tmp/large-out -q
    rm -rf /tmp/large-out bench-data/gptq-77L ;;
  final2)
    # 2026-12-03 (afternoon): every backend from 7 GB GPTQ and AWQ sources, each output verified
    # (verify --level lossless, whole process), moeconv's own modules compiled first (as `pip install`
    # leaves them; the image sets PYTHONDONTWRITEBYTECODE), then the fixed cost with and without bytecode.
    python3 -m compileall -q moeconv
    for format in gptq awq; do
      python3 benchmarks/bench_convert.py --size-gb 7 --format $format --backends triton,compressed-tensors,humming,cpu \
        --repeats 1 --verify --json "$out/${format}7.json"
      rm -rf bench-data/qwen3-like-$format-*
    done
    python3 benchmarks/bench_startup.py --repeats 3 --modes warm,no-pyc --json "$out/startup.json" ;;
  final3)
    # Sources grown from one synthetic layer (benchmarks/grow_checkpoint.py: seconds, not minutes):
    # 7.2 GB GPTQ and AWQ on the backends with each output verified, verify's scaling with workers,
    # then the 25 GB source again (triton, verified).
    python3 -m compileall -q moeconv
    for format in gptq awq; do
      python3 benchmarks/bench_convert.py --size-gb 0.3 --format $format --backends triton --repeats 1 \
        --json "$out/one-layer-$format.json"
      python3 benchmarks/grow_checkpoint.py bench-data/qwen3-like-$format-1L-128E-2048H bench-data/$format-22L --layers 22
    done
    python3 benchmarks/bench_convert.py --source bench-data/gptq-22L --format gptq \
      --backends triton,compressed-tensors,humming,cpu --repeats 1 --verify --json "$out/gptq22.json"
    python3 benchmarks/bench_convert.py --source bench-data/awq-22L --format awq --backends triton,humming \
      --repeats 1 --verify --json "$out/awq22.json"
    rm -rf bench-data/awq-22L /tmp/verified
    python3 -m moeconv convert bench-data/gptq-22L -o /tmp/verified -q --json > "$out/gptq22-triton.json"
    for workers in 4 8 16; do
      begin=$(date +%s.%N)
      python3 -m moeconv verify /tmp/verified --level lossless -q --json --workers $workers > "$out/verify-$workers.json"
      echo "verify --workers $workers: $(python3 -c "print(round($(date +%s.%N) - $begin, 2))") s"
    done
    rm -rf /tmp/verified bench-data/gptq-22L
    python3 benchmarks/grow_checkpoint.py bench-data/qwen3-like-gptq-1L-128E-2048H bench-data/grown-77L --layers 77
    python3 benchmarks/bench_convert.py --source bench-data/grown-77L --format gptq --backends triton \
      --repeats 1 --verify --json "$out/large.json"
    rm -rf bench-data/grown-77L bench-data/qwen3-like-* ;;
  large)
    # One >= 25 GB source (77 layers: one synthetic layer repeated, benchmarks/grow_checkpoint.py), GPTQ ->
    # triton and humming with verify: does the cost grow linearly from the 7 GB rows?
    python3 -m compileall -q moeconv
    python3 benchmarks/bench_convert.py --size-gb 0.3 --format gptq --backends triton --repeats 1 --json "$out/one-layer.json"
    one=$(ls -d bench-data/qwen3-like-gptq-1L-*)
    python3 benchmarks/grow_checkpoint.py "$one" bench-data/grown-77L --layers 77
    rm -rf "$one"
    python3 benchmarks/bench_convert.py --source bench-data/grown-77L --format gptq --backends triton,humming \
      --repeats 1 --verify --json "$out/large.json"
    rm -rf bench-data/grown-77L ;;
  final)
    # Every backend from 7 GB GPTQ and AWQ sources, the whole process and the conversion against a flushed
    # copy (docs/BENCHMARKS.md, 2026-12-03), verify's phases, then the fixed cost with and without bytecode.
    python3 benchmarks/bench_convert.py --size-gb 7 --format gptq --backends triton,compressed-tensors,humming,cpu \
      --repeats 1 --json "$out/gptq7.json"
    src=$(ls -d bench-data/qwen3-like-gptq-*)
    rm -rf /tmp/verified
    python3 -m moeconv convert "$src" -o /tmp/verified -q --json > "$out/gptq7-triton.json"
    python3 -m moeconv verify /tmp/verified --level lossless -q --json > "$out/verify.json" || echo "verify exit $?"
    python3 -c "import json; print('verify', json.load(open('$out/verify.json'))['phase_seconds'])"
    rm -rf /tmp/verified "$src"
    python3 benchmarks/bench_convert.py --size-gb 7 --format awq --backends triton,compressed-tensors,humming \
      --repeats 1 --json "$out/awq7.json"
    python3 benchmarks/bench_startup.py --repeats 3 --modes warm,no-pyc --json "$out/startup.json" ;;
  builds)
    # Which commit made the 16-core conversion slower (docs/BENCHMARKS.md, 2026-12-03): the builds
    # exported to .builds (benchmarks/bench_builds.py export ...) on one 4 GB GPTQ source, then verify's
    # phases on the newest build's output.
    python3 benchmarks/bench_convert.py --size-gb 4 --backends triton --repeats 1 --json "$out/head-triton.json"
    src=$(ls -d bench-data/qwen3-like-gptq-*)
    python3 benchmarks/bench_builds.py run "$src" --builds .builds --backends triton,compressed-tensors \
      --repeats 1 --json "$out/builds.json"
    rm -rf /tmp/verified
    python3 -m moeconv convert "$src" -o /tmp/verified -q --json > "$out/head-convert.json"
    python3 -m moeconv verify /tmp/verified --level lossless -q --json > "$out/verify.json" || echo "verify exit $?"
    python3 -c "import json; print(json.load(open('$out/verify.json'))['phase_seconds'])" ;;
  awq7)
    python3 benchmarks/bench_convert.py --size-gb 7 --format awq --backends triton,humming,compressed-tensors \
      --repeats 1 --json "$out/awq7-backends.json"
    src=$(ls -d bench-data/qwen3-like-awq-*)
    rm -rf /tmp/awq7-triton
    python3 -m moeconv convert "$src" -o /tmp/awq7-triton -q --json > "$out/awq7-convert.json"
    for level in structure lossless; do
      begin=$(date +%s.%N)
      python3 -m moeconv verify /tmp/awq7-triton --level $level -q --json > "$out/awq7-verify-$level.json" \
        || echo "verify $level exit $?"
      echo "verify $level: $(python3 -c "print(round($(date +%s.%N) - $begin, 2))") s"
    done ;;
  scaling7)
    python3 benchmarks/bench_convert.py --size-gb 7 --format gptq --backends triton --workers 1,2,4,16 \
      --repeats 1 --json "$out/gptq7-workers.json"
    python3 benchmarks/bench_convert.py --size-gb 7 --format gptq --backends cpu,compressed-tensors \
      --repeats 1 --json "$out/gptq7-backends.json" ;;
  gptq)
    python3 benchmarks/bench_convert.py --size-gb 4 --format gptq --backends triton --workers 1,2,4,8,16 \
      --repeats 1 --json "$out/gptq-workers.json"
    python3 benchmarks/bench_convert.py --size-gb 4 --format gptq --backends triton,humming,cpu,compressed-tensors \
      --repeats 2 --json "$out/gptq-backends.json" ;;
  scaling)
    python3 benchmarks/bench_convert.py --size-gb 4 --format gptq --backends triton,humming --workers 1,2,4,8,16 \
      --repeats 1 --json "$out/gptq-scaling.json" ;;
  awq)
    python3 benchmarks/bench_convert.py --size-gb 4 --format awq --backends triton --workers 1,4,16 \
      --repeats 1 --json "$out/awq-workers.json"
    python3 benchmarks/bench_convert.py --size-gb 4 --format awq --backends humming,compressed-tensors \
      --repeats 1 --json "$out/awq-backends.json" ;;
esac
