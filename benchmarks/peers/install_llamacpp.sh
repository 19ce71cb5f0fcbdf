#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-imatrix for the peer benchmarks, once; later calls
# reuse it.
#   benchmarks/peers/install_llamacpp.sh        -> .peers/llama.cpp/bin/{llama-server,llama-quantize,llama-imatrix}
#                                                  .peers/llama.cpp/models/smollm2-135m-{bf16,q8_0,q4_0}.gguf
#                                                  .peers/llama.cpp/BUILD_INFO (flags, source, AMX smoke result)
# The source is the llama.cpp vendored in the llama-cpp-python sdist from PyPI (vendor/llama.cpp), so
# nothing but PyPI is needed. convert_hf_to_gguf.py and its gguf-py are kept next to the binaries and run
# from a small venv (.peers/llamacpp-py: numpy, sentencepiece, transformers, CPU torch).
#
# Build: cmake Release, static, -DGGML_NATIVE=ON (-march=native: AVX512/VNNI/BF16 and, on a CPU that
# has them, the AMX tiles). ggml's AMX path (Q4_0/Q8_0 weights repacked for AMX int8 tiles) once crashed on
# this kind of machine, so every model is smoked through llama-server (a 64-token prompt, 8 tokens out, 2
# slots); if any smoke crashes, ggml is rebuilt with GGML_NATIVE=OFF and the CPU's flags spelled out from
# /proc/cpuinfo with every GGML_AMX_* OFF. BUILD_INFO records which build was kept and why.
# Found on the 2-core Intel Xeon dev VM (amx_tile/int8/bf16 in cpuinfo), llama.cpp 0c1e570: the native build
# serves BF16 but dies with SIGSEGV in ggml_backend_amx_mul_mat while loading Q8_0/Q4_0 (the warm-up graph);
# llama-server -nr (no extra buffer types) avoids it, the no-AMX build passes every smoke and is what is used.
# Never part of `make test`: `make bench-peers` runs it. Environment: LLAMACPP_DIR, LLAMACPP_PY_VERSION
# (llama-cpp-python sdist, default 0.3.36), LLAMACPP_JOBS (default 2), LLAMACPP_AMX=off to skip the native try.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DIR=${LLAMACPP_DIR:-.peers/llama.cpp}
PYV=${LLAMACPP_PY_VERSION:-0.3.36}
JOBS=${LLAMACPP_JOBS:-2}
PYENV=${LLAMACPP_PYENV:-.peers/llamacpp-py}
OURPY=${OURPY:-.venv/bin/python}
MODELS=$DIR/models
SRC=$DIR/src
mkdir -p "$DIR" "$MODELS"
log() { echo "[install_llamacpp] $*" >&2; }

# ---- source -------------------------------------------------------------------------------------------
if [[ ! -f $SRC/CMakeLists.txt ]]; then
  dl=$(mktemp -d)
  trap 'rm -rf "$dl"' EXIT
  log "downloading llama-cpp-python==$PYV sdist (vendors llama.cpp)"
  "$OURPY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$PYV" -d "$dl"
  tar xzf "$dl"/llama_cpp_python-"$PYV".tar.gz -C "$dl" "llama_cpp_python-$PYV/vendor/llama.cpp"
  # the submodule's commit: the sdist ships llama-cpp-python's .git, where the vendored tree's HEAD is
  tar xzf "$dl"/llama_cpp_python-"$PYV".tar.gz -O "llama_cpp_python-$PYV/.git/modules/vendor/llama.cpp/HEAD" \
    > "$dl/llama_cpp_python-$PYV/vendor/llama.cpp/.vendored-commit" 2>/dev/null || true
  rm -rf "$SRC.tmp" && mv "$dl/llama_cpp_python-$PYV/vendor/llama.cpp" "$SRC.tmp" && mv "$SRC.tmp" "$SRC"
  echo "$PYV" > "$SRC/.llama-cpp-python-version"
fi
COMMIT=$(cat "$SRC/.vendored-commit" 2>/dev/null || true)
[[ -n $COMMIT ]] || COMMIT=unknown

# ---- build --------------------------------------------------------------------------------------------
COMMON=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON)
NATIVE_FLAGS=(-DGGML_NATIVE=ON)
cpu_has() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }
onoff() { if cpu_has "$1"; then echo ON; else echo OFF; fi; }
NOAMX_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42="$(onoff sse4_2)" -DGGML_AVX="$(onoff avx)" -DGGML_AVX2="$(onoff avx2)"
             -DGGML_FMA="$(onoff fma)" -DGGML_F16C="$(onoff f16c)" -DGGML_BMI2="$(onoff bmi2)"
             -DGGML_AVX_VNNI="$(onoff avx_vnni)" -DGGML_AVX512="$(onoff avx512f)"
             -DGGML_AVX512_VBMI="$(onoff avx512vbmi)" -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
             -DGGML_AVX512_BF16="$(onoff avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)

build() {  # build NAME FLAGS... -> $DIR/build-NAME/bin
  local name=$1; shift
  local b=$DIR/build-$name
  if [[ -x $b/bin/llama-server && -x $b/bin/llama-quantize && -x $b/bin/llama-imatrix && -f $b/.flags ]] && [[ "$(cat "$b/.flags")" == "$*" ]]; then
    log "reusing $b"; return
  fi
  log "configuring $b: $*"
  cmake -S "$SRC" -B "$b" "${COMMON[@]}" "$@" > "$DIR/cmake-$name.log" 2>&1 \
    || { tail -30 "$DIR/cmake-$name.log" >&2; exit 1; }
  log "building llama-server llama-quantize llama-imatrix with -j$JOBS (minutes; log $DIR/build-$name.log)"
  cmake --build "$b" --config Release -j "$JOBS" --target llama-server llama-quantize llama-imatrix > "$DIR/build-$name.log" 2>&1 \
    || { tail -30 "$DIR/build-$name.log" >&2; exit 1; }
  echo "$*" > "$b/.flags"
}

# ---- python for convert_hf_to_gguf.py -------------------------------------------------------------------
pyenv() {
  if [[ -x $PYENV/bin/python ]] && "$PYENV/bin/python" -c "import numpy, sentencepiece, transformers, torch, yaml" 2>/dev/null; then
    return
  fi
  log "creating $PYENV (numpy, sentencepiece, transformers, CPU torch)"
  rm -rf "$PYENV"
  python3 -m venv "$PYENV"
  "$PYENV/bin/python" -m pip install -q --upgrade pip
  "$PYENV/bin/python" -m pip install -q "${LLAMACPP_TORCH_SPEC:-torch==2.13.0}" ${LLAMACPP_TORCH_INDEX:-}
  "$PYENV/bin/python" -m pip install -q numpy sentencepiece transformers safetensors protobuf pyyaml tqdm requests
}

# ---- models --------------------------------------------------------------------------------------------
models() {  # converts once; quantizes with the given build's llama-quantize
  local bin=$1
  local hf
  hf=${PEERS_HF_DIR:-$("$OURPY" -c "from llmopt.models.resolve import resolve_model, weights_dir; print(weights_dir(resolve_model('smollm2-135m')))")}
  if [[ ! -f $MODELS/smollm2-135m-bf16.gguf ]]; then
    pyenv
    log "converting $hf -> $MODELS/smollm2-135m-bf16.gguf"
    "$PYENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$hf" --outtype bf16 --outfile "$MODELS/smollm2-135m-bf16.gguf.tmp" \
      > "$DIR/convert.log" 2>&1 || { tail -30 "$DIR/convert.log" >&2; exit 1; }
    mv "$MODELS/smollm2-135m-bf16.gguf.tmp" "$MODELS/smollm2-135m-bf16.gguf"
  fi
  for q in Q8_0 Q4_0; do
    local out=$MODELS/smollm2-135m-${q,,}.gguf
    if [[ ! -f $out ]]; then
      log "llama-quantize $q -> $out"
      "$bin/llama-quantize" "$MODELS/smollm2-135m-bf16.gguf" "$out.tmp" "$q" 2 > "$DIR/quantize-$q.log" 2>&1 \
        || { tail -30 "$DIR/quantize-$q.log" >&2; exit 1; }
      mv "$out.tmp" "$out"
    fi
  done
}

# ---- smoke: each model through llama-server; 0 ok, 1 crashed/failed ----------------------------------------
smoke() {
  local bin=$1 name=$2 m port=18571 rc=0
  for m in "$MODELS"/smollm2-135m-{bf16,q8_0,q4_0}.gguf; do
    local slog=$DIR/smoke-$name-$(basename "$m" .gguf).log
    "$bin/llama-server" -m "$m" -t 2 -c 1024 --parallel 2 --host 127.0.0.1 --port $port > "$slog" 2>&1 &
    local pid=$!
    if "$OURPY" - "$port" "$pid" <<'EOF' >> "$slog" 2>&1; then log "smoke ok: $name $(basename "$m")"; else rc=1; log "smoke FAILED: $name $(basename "$m") (see $slog)"; fi
import json, os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server died while loading")
    try:
        if urllib.request.urlopen(base + "/health", timeout=1).status == 200:
            break
    except Exception:
        time.sleep(0.2)
else:
    sys.exit("server never healthy")
body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 6, "max_tokens": 8, "temperature": 0}
for _ in range(2):
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=120))
    assert out["choices"][0]["text"] is not None, out
print("smoke ok:", json.dumps(out["choices"][0]["text"]))
EOF
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  return $rc
}

record() {  # record NAME FLAGS...
  local name=$1; shift
  mkdir -p "$DIR/bin"
  ln -sf "../build-$name/bin/llama-server" "$DIR/bin/llama-server"
  ln -sf "../build-$name/bin/llama-quantize" "$DIR/bin/llama-quantize"
  ln -sf "../build-$name/bin/llama-imatrix" "$DIR/bin/llama-imatrix"
  ln -sfn "../src/gguf-py" "$DIR/bin/gguf-py"
  ln -sf "../src/convert_hf_to_gguf.py" "$DIR/bin/convert_hf_to_gguf.py"
  {
    echo "source: llama-cpp-python==$PYV sdist, vendor/llama.cpp commit $COMMIT"
    echo "build: $name"
    echo "cmake: ${COMMON[*]} $*"
    echo "compiler: $(${CC:-cc} --version | head -1)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
    echo "amx_cpu_flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep '^amx' | xargs)"
    echo "smoke: $SMOKE_NOTE"
  } > "$DIR/BUILD_INFO"
  cat "$DIR/BUILD_INFO" >&2
}

if [[ -x $DIR/bin/llama-server && -x $DIR/bin/llama-imatrix && -f $DIR/BUILD_INFO && -f $MODELS/smollm2-135m-q4_0.gguf ]]; then
  log "llama.cpp already installed in $DIR"; cat "$DIR/BUILD_INFO" >&2; exit 0
fi

if [[ ${LLAMACPP_AMX:-auto} != off ]]; then
  build native "${NATIVE_FLAGS[@]}"
  models "$DIR/build-native/bin"
  if smoke "$DIR/build-native/bin" native; then
    SMOKE_NOTE="native build (with the CPU's AMX, if any) served bf16/q8_0/q4_0 without crashing"
    record native "${NATIVE_FLAGS[@]}"; exit 0
  fi
  log "native build crashed in a smoke: rebuilding with AMX off"
  SMOKE_NOTE="native build FAILED the smoke ($(grep -l -E 'died|Error|FAILED' "$DIR"/smoke-native-*.log | xargs -r -n1 basename | xargs || true)); kept the no-AMX build"
else
  SMOKE_NOTE="LLAMACPP_AMX=off: native build not tried"
fi
build noamx "${NOAMX_FLAGS[@]}"
models "$DIR/build-noamx/bin"
smoke "$DIR/build-noamx/bin" noamx || { log "error: the no-AMX build fails its smoke too"; exit 1; }
record noamx "${NOAMX_FLAGS[@]}"
