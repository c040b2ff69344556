#!/usr/bin/env bash
# Builds the wheel set for the offline GPU machine: vLLM 0.26 and what it lacks
# (../shared/gpu/vllm-0.26-wheels.txt) plus this folder's extra-wheels.txt (TRL, the demo model),
# as one tar split into parts that travel one per call (a call carries at most 64 MiB, the working
# tree included). Then each part goes in its own call, back to back, and the last call runs
#   bash .whl/device-install.sh && export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:) && ...
# Run from the project root:  bash benchmarks/gpu/make-parts.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
shared="$root/../shared/gpu"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
stage=$(mktemp -d)
for list in "$shared/vllm-0.26-wheels.txt" "$root/benchmarks/gpu/extra-wheels.txt"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$stage" -r "$list"
done
mkdir -p .whl && rm -f .whl/part*
tar cf - -C "$stage" . | split -b 50000000 -d - .whl/part  # 50 MB: the tree itself is about 7 MB
cp "$shared/device-install.sh" .whl/device-install.sh
rm -rf "$stage"
echo "built $(ls .whl/part* | wc -l) parts in .whl/ ($(du -ch .whl/part* | tail -1 | cut -f1) in all)"
