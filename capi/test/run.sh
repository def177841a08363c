#!/usr/bin/env bash
# Builds libflashdecode.so and the C test programs into OUT, then runs them.
#   capi/test/run.sh OUT
# Environment: CUDA_HOME (default /usr/local/cuda) for cuda.h and the compat header path;
# LIBCUDA_DIR, a folder with the libcuda.so to link against (default $CUDA_HOME/lib64/stubs);
# RUN_LIBCUDA_DIR, a folder put on LD_LIBRARY_PATH when the test runs (CI: the stand-in of
# python/build_backend/make_libcuda.py; leave unset on a GPU machine so the driver's libcuda.so.1 loads);
# RUN_FAKEDEVICE_DIR, a folder with make_libcuda.py --fake-device's libcuda.so.1: when set, fake_test
# also runs there (the library's success path, its launches checked against its plans).
# Run `go generate ./core/cuda` first (the library embeds the fatbin).
set -euo pipefail
OUT=${1:?usage: capi/test/run.sh OUT}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LIBCUDA_DIR=${LIBCUDA_DIR:-$CUDA_HOME/lib64/stubs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
CGO_ENABLED=1 CGO_CFLAGS="-I$ROOT/core/cuda/compat -I$CUDA_HOME/include ${CGO_CFLAGS:--O2 -g}" \
  CGO_LDFLAGS="-L$LIBCUDA_DIR ${CGO_LDFLAGS:--O2 -g}" \
  go build -buildmode=c-shared -o "$OUT/libflashdecode.so" ./capi
for test in decode_test merge_test prepare_test fake_test; do
  ${CC:-gcc} -std=c11 -O2 -Wall -Wextra -Werror -Icapi -I"$CUDA_HOME/include" "capi/test/$test.c" \
    -L"$OUT" -lflashdecode -L"$LIBCUDA_DIR" -lcuda -lpthread -lm -o "$OUT/$test"
done
for test in decode_test merge_test prepare_test; do
  echo "$test:"
  LD_LIBRARY_PATH="$OUT${RUN_LIBCUDA_DIR:+:$RUN_LIBCUDA_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$OUT/$test"
done
if [ -n "${RUN_FAKEDEVICE_DIR:-}" ]; then
  echo "fake_test:"
  rm -f "$OUT/launches.log"
  FAKECUDA_LAUNCH_LOG="$OUT/launches.log" \
    LD_LIBRARY_PATH="$OUT:$RUN_FAKEDEVICE_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$OUT/fake_test"
fi
