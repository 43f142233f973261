#!/usr/bin/env bash
# The engines `gpt2onnx compare` sets beside our exports, in their own environment, .venv-engines (their pins clash
# with .venv's: optimum-intel wants its own optimum, llama-cpp-python its own build): CTranslate2, OpenVINO GenAI with
# optimum-intel and NNCF (OpenVINO IR, int8/int4 weights), and, with ENGINES_LLAMA=1, llama.cpp through
# llama-cpp-python, which PyPI ships as source only: built here, about 10 minutes on 2 cores (GGML_NATIVE, this CPU).
# Safe to rerun: what is installed is kept. gpt2onnx compare finds .venv-engines (or GPT2ONNX_ENGINES_PYTHON).
# Facts met on the way (2026-12): optimum-intel pulls torchvision, whose wheel does not match the CPU torch
# (`operator torchvision::nms does not exist` on `from transformers import GPT2LMHeadModel`): removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
quiet() { grep -v "^WARNING: Location" || true; }
ENGINE_PACKAGES="${TORCH_SPEC:-torch==2.13.0} transformers==4.57.6 ctranslate2==4.8.5 openvino==2026.4.1 \
openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 optimum-intel==2.2.0 nncf==3.4.0 gguf==0.19.0"
[ -x .venv-engines/bin/python ] || "$PYTHON" -m venv .venv-engines
PY=.venv-engines/bin/python
$PY -c "import ctranslate2, openvino_genai, nncf, optimum.intel, gguf, transformers" 2>/dev/null \
  || { $PY -m pip install --quiet --disable-pip-version-check $ENGINE_PACKAGES 2>&1 | quiet
       $PY -m pip uninstall --quiet -y torchvision 2>/dev/null || true; }
if [ "${ENGINES_LLAMA:-0}" = 1 ] && ! $PY -c "import llama_cpp, diskcache" 2>/dev/null; then
  SRC=.venv-engines/src
  mkdir -p "$SRC"
  [ -f "$SRC/llama_cpp_python-0.3.36.tar.gz" ] || $PY -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary :all: llama-cpp-python==0.3.36 -d "$SRC" 2>&1 | quiet
  [ -d "$SRC/llama_cpp_python-0.3.36" ] || tar xzf "$SRC/llama_cpp_python-0.3.36.tar.gz" -C "$SRC"
  # On AMX CPUs GCC 12 miscompiles llama.cpp 0.3.36's AMX tile configuration (every quantized GGUF crashes,
  # llama.cpp #20824): scripts/llama-amx-tilecfg.patch keeps the configuration in static storage, as PR #26954 does.
  MMQ="$SRC/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
  if grep -q amx_int8 /proc/cpuinfo && ! grep -q "static const tile_config_t" "$MMQ"; then
    (cd "$(dirname "$MMQ")" && patch -p0 --quiet) < scripts/llama-amx-tilecfg.patch
  fi
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
    $PY -m pip install --quiet --disable-pip-version-check --no-deps "$SRC/llama_cpp_python-0.3.36" 2>&1 | quiet
  $PY -m pip install --quiet --disable-pip-version-check diskcache==5.6.3 jinja2 typing-extensions 2>&1 | quiet
fi
# llama.cpp's own OpenAI server (python -m llama_cpp.server, beside ours in `gpt2onnx bench served --server openai`):
# llama-cpp-python's [server] extra, pinned (its starlette-context must stay below 0.4)
LLAMA_SERVER_PACKAGES="uvicorn==0.55.0 fastapi==0.165.0 pydantic-settings==2.16.3 sse-starlette==3.7.1 \
starlette-context==0.3.6 PyYAML==6.0.4"
if [ "${ENGINES_LLAMA:-0}" = 1 ] && ! $PY -c "import llama_cpp.server.app" 2>/dev/null; then
  $PY -m pip install --quiet --disable-pip-version-check $LLAMA_SERVER_PACKAGES 2>&1 | quiet
fi
# llama.cpp's C++ server (`bench served --llama-server .venv-engines/bin/llama-server`: continuous batching over
# --parallel slots), from the same sources, with ENGINES_LLAMA_SERVER=1: about 10 minutes on 2 cores
if [ "${ENGINES_LLAMA_SERVER:-0}" = 1 ] && [ ! -x .venv-engines/bin/llama-server ]; then
  [ -d .venv-engines/src/llama_cpp_python-0.3.36 ] || { echo "ENGINES_LLAMA_SERVER=1 needs ENGINES_LLAMA=1 first" >&2; exit 1; }
  BUILD=.venv-engines/llama-server-build
  cmake -S .venv-engines/src/llama_cpp_python-0.3.36/vendor/llama.cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
    > "$BUILD.log" 2>&1
  cmake --build "$BUILD" --target llama-server -j"$(nproc)" >> "$BUILD.log" 2>&1
  ln -sf "../llama-server-build/bin/llama-server" .venv-engines/bin/llama-server
fi
$PY - <<'PY'
import importlib.metadata as m
names = ("ctranslate2", "openvino-genai", "optimum-intel", "nncf", "llama_cpp_python")
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "not installed (ENGINES_LLAMA=1 bash scripts/setup-engines.sh)"
print(" | ".join(f"{n} {version(n)}" for n in names), "(.venv-engines)")
PY
