#!/usr/bin/env bash
# Builds the release wheels: one manylinux2014 (glibc 2.17) wheel per CPython, into DIST.
#   dev/wheels.sh [python ...]      default: python3.10 python3.11 python3.12 python3.13 on PATH
# Needs what a source build needs (Go, and CUDA_HOME or the nvcc wheels: README "Development")
# and PyPI for the pinned tools of dev/wheel-tools.txt (zig as cgo's C compiler, auditwheel).
# Each wheel is built with pip's build isolation, then `auditwheel repair` tags it, leaving out
# libcuda.so.1 (the driver is the user's) and checking every other symbol against the policy.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIST=${DIST:-$root/dist}
tools=$root/_build/wheel-tools
pythons=("$@")
[ ${#pythons[@]} -gt 0 ] || pythons=(python3.10 python3.11 python3.12 python3.13)
if [ ! -x "$tools/bin/auditwheel" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q --require-hashes -r "$root/dev/wheel-tools.txt"
fi
export ZIG="$tools/bin/python -m ziglang" CC="$root/dev/zigcc" PATH="$tools/bin:$PATH"
mkdir -p "$DIST"
for py in "${pythons[@]}"; do
  raw=$(mktemp -d)
  (cd "$root" && "$py" -m pip wheel -q --no-deps . -w "$raw")
  auditwheel repair --plat manylinux_2_17_x86_64 --exclude libcuda.so.1 -w "$DIST" "$raw"/*.whl
  rm -rf "$raw"
done
ls -l "$DIST"
