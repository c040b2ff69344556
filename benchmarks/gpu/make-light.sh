#!/usr/bin/env bash
# Builds .whl/light: the few wheels of light-wheels.txt, for GPU runs that start no vLLM engine
# (about 5 MB: they travel with one call, carry [".whl/light"], instead of make-parts.sh's parts).
# Then:  . benchmarks/gpu/device-env.sh && python3 benchmarks/<script>.py ...
# Run from the project root:  bash benchmarks/gpu/make-light.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl/light && mkdir -p .whl/light
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl/light -r benchmarks/gpu/light-wheels.txt
echo "built .whl/light ($(du -sh .whl/light | cut -f1))"
