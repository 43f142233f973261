#!/usr/bin/env bash
# Set up everything: a virtual environment in .venv with torch, the project, its test tools and the docs site's
# builder (the docs extra: mkdocs and Material, pinned).
# torch is installed first and pinned, so pip does not pull a multi-GB CUDA build where a CPU build is on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
# The other environments install beside .venv (jobs in the background, each one's output in .setup-NAME.log, shown
# when it is done; a failed one fails the set-up). pip writes gpt2onnx.egg-info into this tree for an editable
# install: those run one at a time (flock on .setup.lock).
JOBS=()
job() {  # NAME COMMAND...: run beside the rest
  local name=$1
  shift
  "$@" > ".setup-$name.log" 2>&1 &
  JOBS+=("$name:$!")
}
finish_job() {  # NAME: wait for that job (its output shown), and leave the others running
  local entry rest=()
  for entry in "${JOBS[@]}"; do
    if [ "${entry%%:*}" = "$1" ]; then
      wait_job "$entry"
    else
      rest+=("$entry")
    fi
  done
  JOBS=("${rest[@]}")
}
wait_job() {
  local name=${1%%:*}
  if ! wait "${1##*:}"; then
    cat ".setup-$name.log"
    echo "set-up of $name failed (its output above)" >&2
    exit 1
  fi
  grep -v "^WARNING: Location" ".setup-$name.log" || true
}
finish_jobs() {
  local entry
  for entry in "${JOBS[@]}"; do
    wait_job "$entry"
  done
  JOBS=()
}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if [ "${SKIP_TF5:-0}" != 1 ]; then
  job tf5 bash scripts/setup-tf5.sh  # transformers 5.x (scripts/test-tf5.sh)
fi

# --- other runtimes (deploy targets, --runtime genai): kept apart from the project venv, safe to rerun ------
# onnxruntime-genai depends on the CPU onnxruntime and would install it over onnxruntime-gpu in .venv
# (CUDAExecutionProvider silently gone, pip check silent too): it gets its own venv, .venv-genai, with
# tritonclient[grpc] (which pins protobuf < 7, another reason to keep it out of .venv). transformers.js
# goes into tests/js/node_modules from the committed package-lock.json; --ignore-scripts: no postinstall
# downloads (onnxruntime-node ships its CPU binary in the package). gpt2onnx --runtime genai finds .venv-genai
# (or GPT2ONNX_GENAI_PYTHON) and runs genai in a worker process. SKIP_DEPLOY_RUNTIMES=1 skips this block.
if [ "${SKIP_DEPLOY_RUNTIMES:-0}" != 1 ]; then
  # the engines gpt2onnx compare sets beside ours (.venv-engines: CTranslate2, OpenVINO GenAI, NNCF; llama.cpp with
  # ENGINES_LLAMA=1, a 6-minute build): installed beside the rest, its output shown when it is done
  bash scripts/setup-engines.sh > .venv-engines.log 2>&1 &
  ENGINES_PID=$!
  GENAI_SPEC="${GENAI_SPEC:-onnxruntime-genai==0.18.0}"
  TRITONCLIENT_SPEC="${TRITONCLIENT_SPEC:-tritonclient[grpc]==2.73.0}"
  setup_genai() {
    [ -x .venv-genai/bin/python ] || "$PYTHON" -m venv .venv-genai
    .venv-genai/bin/python -c "import onnxruntime_genai, tritonclient.grpc.model_config_pb2" 2>/dev/null \
      || .venv-genai/bin/python -m pip install --quiet --disable-pip-version-check "$GENAI_SPEC" "$TRITONCLIENT_SPEC"
    .venv-genai/bin/python -c "import onnxruntime_genai as og; print('onnxruntime-genai', og.__version__, '(.venv-genai)')"
  }
  job genai setup_genai
  # Triton Inference Server (deploy --target triton's generation models, tests/targets/test_triton.py, gpt2onnx bench served):
  # nvidia-pytriton bundles a real tritonserver with its Python backend. Its own venv, .venv-triton: the server's
  # Python, with what the served model imports (onnxruntime CPU, onnx, numpy, tokenizers) and gpt2onnx itself,
  # editable and without its dependencies (no torch, no transformers); tritonclient[all] for the tests' clients
  # (it pins protobuf < 7); kserve for the InferenceService checks, dockerfile (BuildKit's parser) for deploy
  # --target server's Dockerfile. gpt2onnx.targets.triton_server finds it
  # (or GPT2ONNX_TRITON_PYTHON) and sets LD_LIBRARY_PATH to its Python's lib/ (a Python built outside Debian:
  # else the backend stub loads Debian's libpython and crashes).
  PYTRITON_SPEC="${PYTRITON_SPEC:-nvidia-pytriton==0.7.0}"
  TRITON_PACKAGES="$PYTRITON_SPEC tritonclient[all]==2.73.0 onnxruntime==1.31.1 onnx==1.23.2 tokenizers==0.22.2 kserve==0.21.0 dockerfile==3.4.0"
  setup_triton() {
    [ -x .venv-triton/bin/python ] || "$PYTHON" -m venv .venv-triton
    # (found, not imported: kserve and tritonclient.grpc register the same protobuf names and fail in one process)
    .venv-triton/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('pytriton', 'tritonclient.grpc', 'tritonclient.http', 'onnxruntime', 'onnx', 'tokenizers', 'kserve', 'dockerfile')))" 2>/dev/null \
      || .venv-triton/bin/python -m pip install --quiet --disable-pip-version-check $TRITON_PACKAGES
    # gpt2onnx from this tree: reinstalled only where the venv's points elsewhere (another clone or worktree)
    .venv-triton/bin/python -P -c "import gpt2onnx, pathlib, sys; sys.exit(pathlib.Path(gpt2onnx.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())" 2>/dev/null \
      || flock .setup.lock .venv-triton/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
    .venv-triton/bin/python -c "import importlib.metadata as m; print('nvidia-pytriton', m.version('nvidia-pytriton'), '| kserve', m.version('kserve'), '(.venv-triton)')"
  }
  job triton setup_triton
  # Chromium for the browser tests (tests/targets/test_web.py, driven by playwright-core from tests/js, which downloads no
  # browser) and QEMU's user-mode emulator for the portability tests (tests/verify/test_portability.py: the same process on
  # an emulated AVX2-only and an SSE4.2-only CPU): Debian's chromium and qemu-user, installed where this runs as root
  # and they are missing (CI); else their tests skip, saying so. CHROMIUM names another binary.
  CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
  setup_apt() {
    local missing=()
    [ -x "$CHROMIUM" ] || missing+=(chromium)
    command -v qemu-x86_64 >/dev/null || missing+=(qemu-user)
    if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing ${missing[*]} (apt-get) for the browser and portability tests"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null \
        || echo "apt-get install ${missing[*]} failed: their tests will skip (under CI=1 they fail)"
    fi
  }
  job apt setup_apt
fi

# --- .venv, the project's own (meanwhile the jobs above install theirs) --------------------------------------------
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
flock .setup.lock .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,optimum,docs,serve,adapters,constrain]' 2>&1 | grep -v "^WARNING: Location" || true
# OpenVINO (gpt2onnx --runtime openvino) goes into .venv: it leaves onnxruntime-gpu alone.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${OPENVINO_SPEC:-openvino==2026.4.1}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import gpt2onnx, torch, onnxruntime; print('gpt2onnx', gpt2onnx.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"

if [ "${SKIP_DEPLOY_RUNTIMES:-0}" != 1 ]; then
  if command -v npm >/dev/null; then
    # npm ls fails when node_modules lacks a package of the lock file (or has another version): then install
    (cd tests/js && npm ls --depth=0 >/dev/null 2>&1) \
      || (cd tests/js && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
    echo "transformers.js $(node -p "require('./tests/js/node_modules/@huggingface/transformers/package.json').version") (tests/js)"
  else
    echo "npm not found: the transformers.js tests will skip (install Node.js 20+)"
  fi
  finish_job apt  # apt-get, one at a time: setup-arm64.sh uses it too
  command -v qemu-x86_64 >/dev/null && echo "$(qemu-x86_64 --version | head -1) (portability tests)"
  # an aarch64 Python with onnxruntime's aarch64 wheel, for the same tests on an emulated ARM CPU (root only)
  if command -v qemu-aarch64 >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    bash scripts/setup-arm64.sh 2>&1 | grep -v "^W: Download is performed unsandboxed" \
      || echo "scripts/setup-arm64.sh failed: the aarch64 portability tests will skip (under CI=1 they fail)"
  fi
  if [ -x "$CHROMIUM" ]; then
    echo "$("$CHROMIUM" --version 2>/dev/null | head -1) (browser tests)"
  else
    echo "Chromium not found at $CHROMIUM: the browser tests will skip (as root: apt-get install chromium)"
  fi
fi
finish_jobs
if [ "${SKIP_DEPLOY_RUNTIMES:-0}" != 1 ]; then
  wait "$ENGINES_PID" || { cat .venv-engines.log; echo "scripts/setup-engines.sh failed: the compare tests will skip (under CI=1 they fail)"; }
  tail -1 .venv-engines.log
fi
# --- end of other runtimes ---------------------------------------------------------------------------------
