#!/usr/bin/env bash
# A venv with vLLM 0.33's Python package on CPU tensors, for the vLLM
# connector's interface and scheduler-side tests against 0.33
# (tests/test_vllm_interface.py, tests/test_vllm_scheduler_side.py). There is
# no CPU build of vLLM 0.33 on PyPI: the CUDA wheel goes in without its
# dependencies (its compiled ops are never loaded: no engine runs here), on
# torch 2.13.0's CPU build (the wheel asks for 2.14.0, whose CPU build is not
# on PyPI; 0.33's Python code imports and runs on 2.13.0), with only the
# packages that importing vLLM's config, KV connector base and metrics, its
# scheduler output, KV cache manager and request, its model runners' KV
# connector code and attention layers' hooks needs (found by trying, each
# pinned and installed without its own dependencies, so that nothing pulls
# CUDA torch or vLLM's CUDA kernels), pytest, and this project (pip install
# -e ., its build folder VENV.build). Idempotent: an existing venv made from
# the same list keeps its packages; the project is installed again each time.
#
# Usage: tools/vllm033_venv.sh VENV [WHEELHOUSE]
#        tools/vllm033_venv.sh --download WHEELHOUSE
# WHEELHOUSE: wheels fetched before (--download fetches them there); what is
# not found there comes from the indexes. Run the tests with
# VLLM_TARGET_DEVICE=cpu (vLLM's CPU platform; without it this CUDA build on
# a machine without a GPU has no platform at all).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"

vllm="vllm==0.33.0"
torch="torch==2.13.0+cpu"
tests=("pytest>=8" "pytest-asyncio>=1.0" "pytest-timeout>=2.2")
# What `import vllm.config`, the KV connector modules and the model runners'
# KV connector code import (transformers' own import-time checks included),
# each without its dependencies.
imports=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
  anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 cloudpickle==3.1.3 einops==0.8.2 fastapi==0.136.3
  frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20
  llguidance==1.7.6 msgspec==0.22.0 multidict==7.2.1 numpy==2.3.5 openai==3.57.0 oss-harmony==0.0.11
  packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0
  propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5
  PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 sniffio==1.3.1
  starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.19.0 truststore==0.10.5
  typing-inspection==0.4.5 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1
)

if [ "${1:-}" = --download ]; then
  wheels="${2:?usage: tools/vllm033_venv.sh --download WHEELHOUSE}"
  mkdir -p "$wheels"
  "$python" -m pip download -q -d "$wheels" --no-deps "$vllm" "${imports[@]}"
  "$python" -m pip download -q -d "$wheels" "$torch" "${tests[@]}"
  exit 0
fi

venv="${1:?usage: tools/vllm033_venv.sh VENV [WHEELHOUSE]}"
wheels="${2:-}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
pip="$venv/bin/pip"

install() {  # ARGS...: pip install ARGS, from WHEELHOUSE alone where given and enough, else from the indexes
  if [ -n "$wheels" ] && [ -d "$wheels" ] \
    && "$pip" install -q --no-index --find-links "$wheels" "$@" 2> "$venv/wheelhouse-install.err"; then
    return
  fi
  [ -z "$wheels" ] || echo "vllm033_venv: not from $wheels: $(grep -v 'is ignored' "$venv/wheelhouse-install.err" | tail -n 2)"
  "$pip" install -q "$@"
}

stamp="$venv/.vllm033-packages"
wanted="$(printf '%s\n' "$vllm" "$torch" "${tests[@]}" "${imports[@]}")"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2> /dev/null)" = "$wanted" ]; then
  echo "vllm033_venv: $venv has the packages already"
else
  if [ -e "$venv" ] && [ ! -e "$venv/.vllm033-venv" ]; then
    echo "vllm033_venv: $venv exists and was not made by this script: remove it, or name another folder" >&2
    exit 1
  fi
  rm -rf "$venv"
  "$python" -m venv "$venv"
  touch "$venv/.vllm033-venv"
  # torch first and alone: the CPU build, never the CUDA one from PyPI.
  install "$torch"
  install --no-deps "$vllm"
  install --no-deps "${imports[@]}"
  install "${tests[@]}"
  printf '%s\n' "$wanted" > "$stamp"
fi
"$pip" install -q -e "$root" --config-settings=build-dir="$venv.build"

# Nothing above may have replaced the CPU torch, and vLLM's modules that the
# connector and its tests use must import.
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" - << 'PY'
import torch
assert torch.__version__ == "2.13.0+cpu", torch.__version__
import vllm
assert vllm.__version__ == "0.33.0", vllm.__version__
import datadist_aio.integrations.vllm.connector  # noqa: F401
import vllm.model_executor.layers.attention.kv_transfer_utils  # noqa: F401
import vllm.v1.worker.gpu.kv_connector  # noqa: F401
import vllm.v1.worker.kv_connector_model_runner_mixin  # noqa: F401
print(f"vllm033_venv: vLLM {vllm.__version__}, torch {torch.__version__}")
PY
