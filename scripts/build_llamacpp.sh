#!/usr/bin/env bash
# Build llama.cpp (CPU, shared library only) from a pinned source the registries give: the PyPI sdist of
# llama-cpp-python, which vendors llama.cpp (vendor/llama.cpp: src/, convert_hf_to_gguf.py, gguf-py) and
# its ctypes bindings (llama_cpp/llama_cpp.py). Everything goes OUTSIDE the repo, into DEST.
#
#   scripts/build_llamacpp.sh [DEST]      # DEST default: $LLAMACPP_DIR or ~/.cache/moe-upcycle/llamacpp
#   python scripts/check_llamacpp.py --llamacpp DEST
#
# Needs cmake >= 3.14, a C++17 compiler and pip (the sdist download builds its metadata with
# scikit-build-core from PyPI). About 5.5 minutes on 2 shared cores (JOBS=2); only the `llama` target is built.
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  # of the sdist PyPI served on 2026-11-23
DEST=${1:-${LLAMACPP_DIR:-$HOME/.cache/moe-upcycle/llamacpp}}
JOBS=${JOBS:-2}
SDIST="llama_cpp_python-$VERSION.tar.gz"

mkdir -p "$DEST"
cd "$DEST"
if [ ! -f "$SDIST" ]; then
  python -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DEST"
fi
echo "$SHA256  $SDIST" | sha256sum -c -
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  tar xzf "$SDIST"
fi
SRC="$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF
cmake --build "$DEST/build" -j"$JOBS" --target llama
# the converter imports sentencepiece for Llama vocabularies; kept beside the build, not installed
[ -d "$DEST/pydeps/sentencepiece" ] || python -m pip install --quiet --target "$DEST/pydeps" sentencepiece
ls "$DEST/build/bin/libllama.so" >/dev/null
echo "llama.cpp built: $DEST (libllama.so in $DEST/build/bin)"
