#!/usr/bin/env bash
# Build llama.cpp's llama-perplexity once, the way ../shared/tools/llama_server.sh builds llama-server:
# the copy vendored in the llama-cpp-python 0.3.36 sdist (llama.cpp commit 0c1e57098), AMX kernels left
# out (ggml's AMX Q4_1 path crashes on some of these CPUs), cached in $LLAMA_DIR. Prints the binary's path.
# Used by scripts/bench_quality.py (~8 min on 2 cores the first time).
#
#   scripts/llama_perplexity.sh build
set -euo pipefail
LLAMA_DIR=${LLAMA_DIR:-$HOME/.cache/tandem-llama-cpp}
SRC=$LLAMA_DIR/llama.cpp-0c1e57098
BIN=$SRC/build/bin/llama-perplexity
PYTHON=${PYTHON:-python3}
mkdir -p "$LLAMA_DIR"

build() {
  [ -x "$BIN" ] && { echo "$BIN"; return; }
  cd "$LLAMA_DIR"
  if [ ! -f "$SRC/build/CMakeCache.txt" ]; then  # a tree configured by llama_server.sh is reused as is
    ls dl/llama_cpp_python-0.3.36.tar.gz >/dev/null 2>&1 || \
      "$PYTHON" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d dl
    rm -rf src && mkdir src && tar -xzf dl/llama_cpp_python-0.3.36.tar.gz -C src
    rm -rf "$SRC" && cp -r src/llama_cpp_python-0.3.36/vendor/llama.cpp "$SRC"
    cd "$SRC"
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
      -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_F16C=ON -DGGML_FMA=ON -DGGML_BMI2=ON -DGGML_AVX=ON -DGGML_AVX2=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >/dev/null
  fi
  cd "$SRC"
  cmake --build build -j"$(nproc)" --target llama-perplexity >/dev/null
  echo "$BIN"
}

case "${1:-}" in
  build) build;;
  *) sed -n '2,7p' "$0"; exit 2;;
esac
