#!/usr/bin/env bash
# GPU check of certchat's llama.cpp patch and design core: build the patched tree with CUDA and run the
# GPU tests (tests/test_patch_gpu.py and tests/test_poisson_cuda.py, marker `gpu`).
#
# A lent GPU machine reaches no registry and only 64 MiB travel there, so the inputs are prepared
# here first, into build/gpu-check/ (git-ignored; pass it as `carry`):
#   llama-src.tar.gz      the pristine llama.cpp parts a `llama` build needs (~6 MB); the patches
#                         themselves travel as tracked files (native/patches/*.patch)
#   site-packages.tar.gz  numpy, llama_cpp (Python bindings), pytest and what they import (~30 MB)
#   tiny-qwen2-f16.gguf, tiny-qwen2-f32.gguf   random-weights models (agent/lab/tiny_gguf.py)
#   core/                 the design core's libraries as built here (the CUDA one with nvcc, CERTCHAT_CUDA=1)
#
#   scripts/gpu_check.sh prepare            here, no GPU needed
#   scripts/gpu_check.sh build              on the GPU machine: apply the patches, CUDA build (~5-8 min, 16 cores)
#   scripts/gpu_check.sh test               on the GPU machine: pytest -m gpu (~1 min)
#   scripts/gpu_check.sh all                build + test
#   scripts/gpu_check.sh configure          dry run of `build` without compiling (works without a GPU)
#
# Environment: CUDA_ARCH (default 90, the H100/H200), CERTCHAT_LLAMA_SRC (pristine tree to pack;
# default: the tree native/build.py extracted from the sdist), PYTHON (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/build/gpu-check"
PYTHON="${PYTHON:-python3}"
CUDA_ARCH="${CUDA_ARCH:-90}"
JOBS="$(nproc)"

die() { echo "gpu_check: $*" >&2; exit 1; }
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

prepare() {
    local venv_py="$ROOT/.venv/bin/python"
    [[ -x "$venv_py" ]] || die "no project venv at $ROOT/.venv"
    local src="${CERTCHAT_LLAMA_SRC:-}"
    if [[ -z "$src" ]]; then
        src="$(ls -d "${HOME}"/.cache/certchat/native/src/llama.cpp-* 2>/dev/null | head -1 || true)"
    fi
    [[ -n "$src" && -f "$src/CMakeLists.txt" ]] || die "no pristine llama.cpp tree: run \`certchat build\` once or set CERTCHAT_LLAMA_SRC"
    mkdir -p "$OUT"
    stamp "packing the pristine llama.cpp tree from $src"
    tar czf "$OUT/llama-src.tar.gz" -C "$src" --exclude=.git --exclude=.complete .
    stamp "writing the tiny models"
    (cd "$ROOT" && "$venv_py" -m agent.lab.tiny_gguf qwen2 "$OUT/tiny-qwen2-f16.gguf" --dtype f16)
    (cd "$ROOT" && "$venv_py" -m agent.lab.tiny_gguf qwen2 "$OUT/tiny-qwen2-f32.gguf" --dtype f32)
    stamp "copying the design core's libraries (C++ and CUDA, built here by \`certchat build\`)"
    local built
    built="$(cd "$ROOT" && "$venv_py" -c 'from native import runtime; print(runtime.built_libs().lib_dir)')"
    [[ -f "$built/libcertchat_core_cuda.so" ]] \
        || die "no CUDA design core in $built: rebuild with \`CERTCHAT_CUDA=1 certchat build\` where nvcc exists"
    mkdir -p "$OUT/core"
    cp "$built/libcertchat_core.so" "$built/libcertchat_core_cuda.so" "$OUT/core/"
    stamp "packing the Python packages the tests import"
    local site
    site="$("$venv_py" -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')"
    local pkgs=()
    for p in numpy numpy.libs llama_cpp _pytest pytest py.py pluggy iniconfig packaging diskcache jinja2 markupsafe \
             typing_extensions.py pytest_timeout.py tomli platformdirs; do
        [[ -e "$site/$p" ]] && pkgs+=("$p")
    done
    tar czf "$OUT/site-packages.tar.gz" -C "$site" --exclude=__pycache__ "${pkgs[@]}"
    "$venv_py" -c 'import sys; print(f"python {sys.version_info.major}.{sys.version_info.minor}")' > "$OUT/python-version"
    du -ch "$OUT"/*.tar.gz "$OUT"/*.gguf | tail -1 | sed 's/^/  carry total: /'
    local bytes
    bytes=$(du -cb "$OUT"/*.tar.gz "$OUT"/*.gguf "$OUT"/python-version "$OUT"/core | tail -1 | cut -f1)
    (( bytes < 60 * 1024 * 1024 )) || die "the carried files exceed 60 MiB ($bytes bytes)"
    stamp "ready: carry build/gpu-check"
}

# cuBLAS where the toolkit beside nvcc has none (an image whose cuBLAS came with a Python wheel): point
# CMake's CUDA::cublas at the wheel's library and headers, and remember its folder for the loader.
find_cublas() {
    local -n args=$1
    local tk
    tk="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    rm -f "$OUT/cublas-dir"
    compgen -G "$tk/lib64/libcublas.so*" > /dev/null && return 0
    compgen -G "$tk/targets/*/lib/libcublas.so*" > /dev/null && return 0
    local lib inc
    lib="$(find /usr /opt -name 'libcublas.so*' -not -name '*.py' 2>/dev/null | sort | head -1 || true)"
    [[ -n "$lib" ]] || return 0
    local dir; dir="$(dirname "$lib")"
    inc="$(find "$(dirname "$dir")" /usr /opt -name cublas_v2.h 2>/dev/null | head -1 || true)"
    [[ -n "$inc" ]] || { stamp "cuBLAS library at $dir but no cublas_v2.h"; return 0; }
    local lt; lt="$(ls "$dir"/libcublasLt.so* | head -1)"
    args=("-DCUDA_cublas_LIBRARY=$lib" "-DCUDA_cublasLt_LIBRARY=$lt"
          "-DCMAKE_CUDA_FLAGS=-I$(dirname "$inc")" "-DCMAKE_CXX_FLAGS=-I$(dirname "$inc")")
    echo "$dir" > "$OUT/cublas-dir"
    stamp "the toolkit at $tk has no cuBLAS: using $lib"
}

configure_tree() {
    [[ -f "$OUT/llama-src.tar.gz" ]] || die "build/gpu-check/llama-src.tar.gz is missing: run \`$0 prepare\` where the project is set up"
    rm -rf "$OUT/src"
    mkdir -p "$OUT/src"
    tar xzf "$OUT/llama-src.tar.gz" -C "$OUT/src"
    for p in "$ROOT"/native/patches/*.patch; do
        (cd "$OUT/src" && GIT_CEILING_DIRECTORIES="$OUT" git apply --whitespace=nowarn -p1 "$p") || die "patch $(basename "$p") does not apply"
        stamp "applied $(basename "$p")"
    done
    # git apply inside another repository's work tree skips paths silently: check that it changed the tree
    grep -q llama_certchat_patch_version "$OUT/src/include/llama.h" || die "the patches did not change the tree"
    local gen=()
    command -v ninja > /dev/null && gen=(-G Ninja)
    local cublas=()
    find_cublas cublas
    cmake -S "$OUT/src" -B "$OUT/cuda" "${gen[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_CCACHE=OFF \
        -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON '-DCMAKE_BUILD_RPATH=$ORIGIN' \
        -DGGML_CUDA=ON -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH" "${cublas[@]}" \
        > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; die "cmake configure failed (log: build/gpu-check/configure.log)"; }
    stamp "configured (CUDA arch $CUDA_ARCH; flash-attention kernels off: the certificate does not use them)"
}

build() {
    local t0=$SECONDS
    configure_tree
    stamp "building libllama with CUDA, $JOBS jobs"
    cmake --build "$OUT/cuda" --target llama -j "$JOBS" > "$OUT/build.log" 2>&1 \
        || { tail -40 "$OUT/build.log"; die "CUDA build failed (log: build/gpu-check/build.log)"; }
    rm -rf "$OUT/lib"
    mkdir -p "$OUT/lib"
    find "$OUT/cuda" -name 'lib*.so*' -exec cp -P {} "$OUT/lib/" \;
    stamp "built in $((SECONDS - t0)) s: $(ls "$OUT/lib" | tr '\n' ' ')"
}

run_tests() {
    [[ -f "$OUT/lib/libllama.so" ]] || die "no CUDA build in build/gpu-check/lib: run \`$0 build\` first"
    local want have
    want="$(cat "$OUT/python-version")"
    have="$("$PYTHON" -c 'import sys; print(f"python {sys.version_info.major}.{sys.version_info.minor}")')"
    if [[ ! -d "$OUT/py/_pytest" ]]; then
        mkdir -p "$OUT/py"
        tar xzf "$OUT/site-packages.tar.gz" -C "$OUT/py"
    fi
    if [[ "$want" != "$have" ]]; then
        # the packed numpy is compiled for $want; the rest of the pack is pure Python
        "$PYTHON" -c 'import numpy' 2> /dev/null \
            || die "the packed site-packages are for $want, this machine runs $have without numpy (set PYTHON=...)"
        rm -rf "$OUT/py/numpy" "$OUT/py/numpy.libs"
        stamp "packed for $want, running $have: its own numpy ($("$PYTHON" -c 'import numpy; print(numpy.__version__)')), the pack's pure-Python packages"
    fi
    # the design core beside the CUDA libllama: tests/test_poisson_cuda.py loads it from the same folder
    [[ -d "$OUT/core" ]] && cp "$OUT"/core/*.so "$OUT/lib/"
    [[ -f "$OUT/cublas-dir" ]] && export LD_LIBRARY_PATH="$(cat "$OUT/cublas-dir")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    stamp "running the GPU tests"
    # LD_PRELOAD: libllama before anything else. With the H200 image's numpy (2.5.2) imported first, the model
    # load crashed; with libllama loaded first it ran.
    (cd "$ROOT" && \
        LD_PRELOAD="$OUT/lib/libllama.so${LD_PRELOAD:+:$LD_PRELOAD}" PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONPATH="$ROOT:$OUT/py" CERTCHAT_NATIVE_LIB_DIR="$OUT/lib" CERTCHAT_TINY_GGUF_DIR="$OUT" CERTCHAT_REQUIRE_GPU=1 \
        "$PYTHON" -m pytest -q -m gpu tests/test_patch_gpu.py tests/test_poisson_cuda.py -p no:cacheprovider -o addopts="-ra" "$@")
}

case "${1:-}" in
    prepare) prepare ;;
    configure) configure_tree ;;
    build) build ;;
    test) shift; run_tests "$@" ;;
    all) build; run_tests ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
esac
