#!/usr/bin/env bash
# One batch of GPU scenarios on the GPU machine (never in CI), all output in one tarball:
#   bash tests/gpu/run_device.sh WAVE OUTDIR        WAVE: jobs | node1 | node2 | fast | diag | fr | frcost | frwarm | catalogue | slow | exception
# The machine has PyTorch but not our dependencies: carry them as wheels in .whl/ (README,
# "Running the GPU scenarios"). jobs needs 2 GPUs; node runs on one. The tables name the commit from
# tests/gpu/COMMIT (git rev-parse --short HEAD > tests/gpu/COMMIT); git ignores it, so carry it too.
set -u
cd "$(dirname "$0")/../.."
wave=$1 out=$2
work=/tmp/devout/$wave
rm -rf "$work"  # a warm machine keeps the last call's files
mkdir -p "$work" "$out"
# Once per machine: waves run side by side share it (a warm machine keeps it).
[ -e /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 && touch /tmp/site/.installed; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export HANGWATCHD_COMMIT=${HANGWATCHD_COMMIT:-$(cat tests/gpu/COMMIT 2>/dev/null || echo unknown)}
nvidia-smi -L
run() {  # NAME CMD...: its output into $work/NAME.log, its exit status printed
  local name=$1; shift
  "$@" >"$work/$name.log" 2>&1
  echo "== $name: exit $?"
}
case "$wave" in
  jobs)  # issue 22: uneven data and a diverged rank on another node, then SIGKILL and abort; the hang held 100 s past its incident, about 2 minutes of hang each
    run uneven python3 tests/gpu/run_jobs.py "$work/hold" --scenario uneven --hold 100 &
    run nodes python3 tests/gpu/run_nodes.py "$work/nodes" 100 &
    wait
    run killed python3 tests/gpu/run_jobs.py "$work/hold" --scenario killed --hold 100 &
    run abort python3 tests/gpu/run_jobs.py "$work/abort" --scenario killed --on-hang abort &
    wait
    for n in uneven nodes killed abort; do echo "######## $n"; tail -c 2500 "$work/$n.log"; done ;;
  node1)  # issues 18, 19, 20 on one GPU
    run one_incident python3 tests/gpu/run_one_incident.py "$work/one_incident" --hold 120
    run cause python3 tests/gpu/run_cause.py "$work/cause"
    run xid python3 tests/gpu/run_xid.py "$work/xid"
    for n in one_incident cause xid; do echo "######## $n"; tail -c 3000 "$work/$n.log"; done ;;
  node2)  # issues 19 and 21 on one GPU: timings, one scenario at a time
    run cause python3 tests/gpu/run_cause.py "$work/cause"
    run fast python3 tests/gpu/run_fast.py "$work/fast"
    HANGWATCHD_BENCH_OUT=$work run symbolize python3 bench/symbolize.py --name symbolize_h200 tests/fixtures/gpu/*/coredump.nvcudmp.xz
    for n in cause fast symbolize; do echo "######## $n"; tail -c 3500 "$work/$n.log"; done ;;
  fast)  # issue 21 alone: the capture timings on one GPU
    run fast python3 tests/gpu/run_fast.py "$work/fast"
    echo "######## fast"; tail -c 5000 "$work/fast.log" ;;
  diag)  # issue 21's misses taken apart (flight recorder timing, 8 dumps at once), then big dumps symbolised
    run diag python3 tests/gpu/run_diag.py "$work/diag" /tmp/bigdumps
    big=$(find /tmp/bigdumps -name '*.nvcudmp' -size -400M)
    HANGWATCHD_BENCH_OUT=$work run symbolize python3 bench/symbolize.py --name symbolize_h200 tests/fixtures/gpu/*/coredump.nvcudmp.xz $big
    for n in diag symbolize; do echo "######## $n"; tail -c 5000 "$work/$n.log"; done ;;
  frcost)  # a flight-recorder dump's seconds against its entries, in-process, with and without stack traces
    run frcost python3 tests/gpu/fr_cost.py "$work/frcost"
    run hang10 timeout 200 python3 tests/gpu/fr_cost.py "$work/frcost" --hang 10
    run hang400 timeout 200 python3 tests/gpu/fr_cost.py "$work/frcost" --hang 400
    for n in frcost hang10 hang400; do echo "######## $n"; tail -c 3000 "$work/$n.log"; done ;;
  frwarm)  # the first dump asked while the rank takes its steps (the daemon's warm-up), then the hang's dump
    run warm10 timeout 200 python3 tests/gpu/fr_cost.py "$work/frcost" --hang 0 --warm-while-running 10
    run warm3 timeout 200 python3 tests/gpu/fr_cost.py "$work/frcost" --hang 0 --warm-while-running 3
    for n in warm10 warm3; do echo "######## $n"; tail -c 3000 "$work/$n.log"; done ;;
  fr)  # where PyTorch's flight recorder spends its seconds
    run diag python3 tests/gpu/run_diag.py "$work/diag" --only-fr
    echo "######## diag"; tail -c 9000 "$work/diag.log" ;;
  catalogue)  # issue 27: the GPU hang classes and the healthy GPU-bound loop under one daemon, one at a time (one GPU: two
    # classes at once share it, and each one's verdict then names the other's load and faults beside its own)
    HANGWATCHD_BENCH_OUT=$work run catalogue timeout 560 python3 -m bench.catalogue --gpu -k gpu --jobs 1 --no-fail \
      --workdir "$work/cat" --json "$work/catalogue_gpu.json"
    echo "######## catalogue"; tail -c 6000 "$work/catalogue.log" ;;
  slow)  # issue 29: four ranks of one job on one GPU, rank 2 launching more kernels each step: the slow incident names it
    run slow timeout 560 python3 tests/gpu/run_slow.py "$work/slow"
    echo "######## slow"; tail -c 6000 "$work/slow.log" ;;
  exception)  # issue 28: GPU exceptions caught alive through the daemon's FIFO (eager, a CUDA graph), then the catalogue's model-thread case
    run exception timeout 100 python3 tests/gpu/run_exception.py "$work/exception"
    HANGWATCHD_BENCH_OUT=$work run catalogue timeout 90 python3 -m bench.catalogue --gpu -k gpu_model_thread_died_on_cuda_error \
      --jobs 1 --no-fail --no-write --workdir "$work/cat" --json "$work/catalogue_gpu.json"
    cp "$work/exception/exception.json" "$work/catalogue_gpu.json" "$out/" 2>/dev/null
    for n in exception catalogue; do echo "######## $n"; tail -c 5000 "$work/$n.log"; done ;;
  *) echo "unknown wave $wave" >&2; exit 2 ;;
esac
find "$work" -name '*.zst' -delete
tar czf "$out/$wave.tgz" -C /tmp/devout "$wave"
