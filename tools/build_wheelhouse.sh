#!/usr/bin/env bash
# Build a wheelhouse for installing this project on GPU nodes without internet access.
# Run `tools/build_wheelhouse.sh --help` for usage; docs/gpu.md explains the offline route.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: tools/build_wheelhouse.sh --output DIR [--with-te VERSION] [--with-apex REF]
                                 [--python PY] [--overwrite]

Build a wheelhouse (a directory of wheels) on a machine WITH internet access, to install this
project on GPU nodes WITHOUT it. Run it where the result will match the cluster: same CPU
architecture, Python 3.12, a glibc no newer than the cluster's and, with --with-te or
--with-apex, the CUDA toolkit matching the wheelhouse's torch. The cluster's login node, or
the container image the jobs run in, is the safest place.

Options:
  --output DIR       directory for the wheels (required). It must be absent or empty
                     unless --overwrite is given.
  --with-te VERSION  also build Transformer Engine VERSION (e.g. 2.20.2):
                     transformer_engine_torch compiled against the wheelhouse's torch
                     (pip wheel --no-build-isolation), plus the transformer_engine
                     metapackage, its CUDA core wheel and its other dependencies.
  --with-apex REF    also build NVIDIA apex at git REF (branch, tag or commit) of
                     https://github.com/NVIDIA/apex with its C++ and CUDA extensions
                     (APEX_CPP_EXT=1 APEX_CUDA_EXT=1).
  --python PY        interpreter to build for [python3.12]; must be Python 3.12.
  --overwrite        build into a non-empty DIR; the *.whl files already there are
                     deleted first, other files are left alone.
  -h, --help         show this text.

Steps:
  1. PY -m pip wheel -r requirements.txt -w DIR   (every project dependency, torch included)
  2. only with --with-te / --with-apex: a throw-away venv of PY under $TMPDIR gets torch
     from DIR plus build tools from the index; TE / apex are built in it with
     --no-build-isolation, so they compile against exactly the torch in DIR.
  3. DIR/requirements.txt (a copy) and DIR/INSTALL.txt (the offline install commands and
     the Python, glibc, torch, CUDA and nvcc versions the wheelhouse was built for).

Environment (read by pip and the builds, not by this script):
  PIP_INDEX_URL, PIP_EXTRA_INDEX_URL  where torch comes from (e.g. a PyTorch CUDA index)
  MAX_JOBS                            parallel compile jobs (TE, apex); lower it on small hosts
  NVTE_CUDA_ARCHS                     TE target GPUs, e.g. "90" for H100 only (faster build)
  NVTE_PYTORCH_FORCE_BUILD=TRUE       TE: compile even when a matching prebuilt wheel exists
  TORCH_CUDA_ARCH_LIST                apex target GPUs, e.g. "9.0"
  CUDA_HOME, CUDNN_PATH               toolkit and cuDNN locations, if not found otherwise
  TMPDIR                              where the throw-away build venv goes (needs several GB)

Exit status: 0 done; 2 bad arguments or unsuitable interpreter (the message names the flag);
1 or pip's status: a build step failed.
EOF
}

PROG=build_wheelhouse.sh
APEX_URL=https://github.com/NVIDIA/apex.git

usage_error() {
    echo "$PROG: error: $*" >&2
    echo "$PROG: run with --help for usage" >&2
    exit 2
}
die() {
    echo "$PROG: error: $*" >&2
    exit 1
}
log() {
    echo "==> $*" >&2
}

OUTPUT=""
TE_VERSION=""
APEX_REF=""
PY="python3.12"
OVERWRITE=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --output | --with-te | --with-apex | --python)
            if [[ $# -lt 2 || -z "$2" || "$2" == --* ]]; then
                usage_error "$1 needs a value"
            fi
            case "$1" in
                --output) OUTPUT="$2" ;;
                --with-te) TE_VERSION="$2" ;;
                --with-apex) APEX_REF="$2" ;;
                --python) PY="$2" ;;
            esac
            shift 2
            ;;
        --output=* | --with-te=* | --with-apex=* | --python=*)
            value="${1#*=}"
            [[ -n "$value" ]] || usage_error "${1%%=*} needs a value"
            case "$1" in
                --output=*) OUTPUT="$value" ;;
                --with-te=*) TE_VERSION="$value" ;;
                --with-apex=*) APEX_REF="$value" ;;
                --python=*) PY="$value" ;;
            esac
            shift
            ;;
        --overwrite)
            OVERWRITE=1
            shift
            ;;
        *)
            usage_error "unknown argument: $1"
            ;;
    esac
done

# ---- argument checks (nothing is downloaded or written before these pass) ----
[[ -n "$OUTPUT" ]] || usage_error "--output DIR is required"
if [[ -e "$OUTPUT" && ! -d "$OUTPUT" ]]; then
    usage_error "--output $OUTPUT exists and is not a directory"
fi
if [[ -d "$OUTPUT" && -n "$(ls -A -- "$OUTPUT")" && "$OVERWRITE" -eq 0 ]]; then
    usage_error "--output $OUTPUT is not empty; pass --overwrite to build into it" \
        "(its *.whl files are deleted first) or choose an empty directory"
fi
if [[ -n "$TE_VERSION" && ! "$TE_VERSION" =~ ^[0-9]+(\.[0-9]+)+([.+a-z0-9]*)$ ]]; then
    usage_error "--with-te expects a Transformer Engine version such as 2.20.2, got '$TE_VERSION'"
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    usage_error "--python $PY: no such interpreter (pass --python /path/to/python3.12)"
fi
if ! PY_MINOR="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)"; then
    usage_error "--python $PY: could not run it"
fi
if [[ "$PY_MINOR" != "3.12" ]]; then
    usage_error "--python $PY is Python $PY_MINOR; this project needs Python 3.12" \
        "(megatron-core >= 0.17 requires it), and the wheels must match the cluster's Python"
fi
if [[ -n "$APEX_REF" ]] && ! command -v git >/dev/null 2>&1; then
    usage_error "--with-apex needs git on PATH (pip clones $APEX_URL)"
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQUIREMENTS="$REPO_ROOT/requirements.txt"
[[ -f "$REQUIREMENTS" ]] || die "$REQUIREMENTS not found"

# nvcc as torch.utils.cpp_extension would find it: CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda.
find_nvcc() {
    local candidate
    for candidate in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" \
        "$(command -v nvcc 2>/dev/null || true)" /usr/local/cuda/bin/nvcc; do
        if [[ -n "$candidate" && -x "$candidate" ]]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}
NVCC="$(find_nvcc || true)"
NVCC_RELEASE=""
if [[ -n "$NVCC" ]]; then
    NVCC_RELEASE="$("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)"
fi
if [[ -n "$APEX_REF" && -z "$NVCC" ]]; then
    usage_error "--with-apex needs the CUDA toolkit (nvcc not found via CUDA_HOME, CUDA_PATH, PATH" \
        "or /usr/local/cuda); apex's CUDA extensions are compiled here"
fi
if [[ -n "$TE_VERSION" && -z "$NVCC" ]]; then
    echo "$PROG: warning: nvcc not found; --with-te can then only use a prebuilt" \
        "transformer_engine_torch wheel from TE's GitHub release, compiling it would fail" >&2
fi

mkdir -p -- "$OUTPUT"
OUT="$(cd -- "$OUTPUT" && pwd)"
if [[ "$OVERWRITE" -eq 1 ]]; then
    shopt -s nullglob
    stale=("$OUT"/*.whl)
    shopt -u nullglob
    if [[ ${#stale[@]} -gt 0 ]]; then
        log "--overwrite: deleting ${#stale[@]} existing wheel(s) in $OUT"
        rm -f -- "${stale[@]}"
    fi
fi
cp -- "$REQUIREMENTS" "$OUT/requirements.txt"

# ---- 1. project requirements (torch included) ----
log "1/3 project requirements -> $OUT"
"$PY" -m pip wheel --wheel-dir "$OUT" -r "$OUT/requirements.txt"

# ---- 2. Transformer Engine / apex, built against the wheelhouse's torch ----
TORCH_LINE=""
if [[ -n "$TE_VERSION" || -n "$APEX_REF" ]]; then
    BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse-build.XXXXXX")"
    trap 'rm -rf -- "$BUILD_DIR"' EXIT
    log "2/3 build venv in $BUILD_DIR (torch from the wheelhouse, build tools from the index)"
    "$PY" -m venv "$BUILD_DIR/venv"
    BPY="$BUILD_DIR/venv/bin/python"
    "$BPY" -m pip install --no-index --find-links "$OUT" -c "$OUT/requirements.txt" torch
    # TE's source build wants CMake, Ninja, pybind11 and (recent releases) nvidia-cudnn-frontend;
    # with --no-build-isolation they must be in the building environment.
    "$BPY" -m pip install setuptools wheel packaging pybind11 ninja cmake nvidia-cudnn-frontend

    TORCH_INFO="$("$BPY" -c 'import torch; print(torch.__version__, torch.version.cuda)')" ||
        die "torch from the wheelhouse does not import in the build venv ($BPY)"
    read -r TORCH_VERSION TORCH_CUDA <<<"$TORCH_INFO"
    TORCH_LINE="torch $TORCH_VERSION (CUDA $TORCH_CUDA)"
    if [[ "$TORCH_CUDA" == "None" ]]; then
        die "the wheelhouse's torch $TORCH_VERSION is a CPU-only build; TE and apex need a CUDA" \
            "build (point PIP_INDEX_URL / PIP_EXTRA_INDEX_URL at a PyTorch CUDA index and rerun)"
    fi
    if [[ -n "$NVCC_RELEASE" && "${NVCC_RELEASE%%.*}" != "${TORCH_CUDA%%.*}" ]]; then
        die "nvcc $NVCC ($NVCC_RELEASE) and torch ($TORCH_CUDA) have different CUDA major versions;" \
            "set CUDA_HOME to a CUDA $TORCH_CUDA toolkit"
    fi

    if [[ -n "$TE_VERSION" ]]; then
        log "2/3 Transformer Engine $TE_VERSION (transformer_engine_torch built here; can take a long time)"
        # The metapackage's [pytorch] extra pulls transformer_engine_torch (a source distribution,
        # compiled here against the venv's torch), which pulls transformer_engine_cu<major of
        # torch.version.cuda> (a binary wheel). -c keeps shared dependencies at the project's pins.
        NVTE_FRAMEWORK=pytorch "$BPY" -m pip wheel --no-build-isolation \
            --wheel-dir "$OUT" --find-links "$OUT" -c "$OUT/requirements.txt" \
            "transformer_engine[pytorch]==$TE_VERSION"
    fi

    if [[ -n "$APEX_REF" ]]; then
        if [[ -n "$NVCC_RELEASE" && "$NVCC_RELEASE" != "$TORCH_CUDA" ]]; then
            die "--with-apex: apex's setup.py refuses nvcc $NVCC_RELEASE for a torch built with CUDA" \
                "$TORCH_CUDA; set CUDA_HOME to a CUDA $TORCH_CUDA toolkit"
        fi
        log "2/3 apex $APEX_REF with C++/CUDA extensions"
        APEX_CPP_EXT=1 APEX_CUDA_EXT=1 "$BPY" -m pip wheel --no-build-isolation --no-deps \
            --wheel-dir "$OUT" "apex @ git+$APEX_URL@$APEX_REF"
        APEX_COMMIT="$(git ls-remote "$APEX_URL" "$APEX_REF" 2>/dev/null | head -n 1 | cut -f 1 || true)"
    fi
fi

# ---- 3. INSTALL.txt ----
log "3/3 writing $OUT/INSTALL.txt"
if [[ -z "$TORCH_LINE" ]]; then
    # torch is not installed anywhere here: read torch/version.py out of the wheel.
    TORCH_LINE="$("$PY" - "$OUT" <<'PYEOF'
import glob, re, sys, zipfile
wheels = sorted(glob.glob(sys.argv[1] + "/torch-*.whl"))
if not wheels:
    print("torch: no torch wheel in the wheelhouse")
    sys.exit(0)
src = zipfile.ZipFile(wheels[-1]).read("torch/version.py").decode()
ver = re.search(r"^__version__\s*=\s*'([^']*)'", src, re.M)
cuda = re.search(r"^cuda\b[^=]*=\s*'([^']*)'", src, re.M)
print("torch %s (CUDA %s)" % (ver.group(1) if ver else "?", cuda.group(1) if cuda else "none: CPU-only build"))
PYEOF
)"
fi
PY_FULL="$("$PY" -c 'import platform; print(platform.python_version())')"
PLATFORM="$("$PY" -c 'import sysconfig; print(sysconfig.get_platform())')"
LIBC="$("$PY" -c 'import platform; print(" ".join(platform.libc_ver()) or "unknown")')"
PIP_VERSION="$("$PY" -m pip --version | cut -d ' ' -f 2)"
if [[ -n "$NVCC" ]]; then
    NVCC_LINE="$("$NVCC" --version 2>/dev/null | grep -i 'release' | head -n 1)  [$NVCC]"
else
    NVCC_LINE="not found"
fi
WHEEL_COUNT="$(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l | tr -d ' ')"

{
    echo "Offline wheelhouse for megatron_ext, built $(date -u '+%Y-%m-%d %H:%M UTC') by tools/build_wheelhouse.sh"
    echo
    echo "Built for (the cluster must match):"
    echo "  Python     $PY_FULL ($PY), pip $PIP_VERSION"
    echo "  platform   $PLATFORM, $LIBC (wheels compiled here need this glibc or newer)"
    echo "  torch      ${TORCH_LINE#torch }"
    echo "  nvcc       $NVCC_LINE"
    if [[ -n "$TE_VERSION" ]]; then
        echo "  TE         transformer_engine $TE_VERSION (transformer_engine_torch built against the torch above)"
    else
        echo "  TE         not included"
    fi
    if [[ -n "$APEX_REF" ]]; then
        echo "  apex       $APEX_URL @ $APEX_REF${APEX_COMMIT:+ (commit $APEX_COMMIT)}, APEX_CPP_EXT=1 APEX_CUDA_EXT=1"
    else
        echo "  apex       not included"
    fi
    echo "  wheels     $WHEEL_COUNT"
    echo
    echo "Install on the cluster (no network needed). Change WHEELHOUSE if you moved this directory."
    echo
    echo "  WHEELHOUSE=$OUT"
    echo "  python3.12 -m venv .venv && . .venv/bin/activate"
    echo "  pip install --no-index --find-links \"\$WHEELHOUSE\" -r \"\$WHEELHOUSE/requirements.txt\""
    if [[ -n "$TE_VERSION" ]]; then
        echo "  pip install --no-index --find-links \"\$WHEELHOUSE\" -c \"\$WHEELHOUSE/requirements.txt\" \"transformer_engine[pytorch]==$TE_VERSION\""
    fi
    if [[ -n "$APEX_REF" ]]; then
        echo "  pip install --no-index --find-links \"\$WHEELHOUSE\" --no-deps apex   # NVIDIA apex from this directory; never 'apex' from PyPI"
    fi
    echo
    echo "Check (from the repository root, on a GPU node):"
    echo
    echo "  python -c \"import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())\""
    if [[ -n "$TE_VERSION" ]]; then
        echo "  python -c \"import transformer_engine.pytorch, transformer_engine as te; print(te.__version__)\""
    fi
    if [[ -n "$APEX_REF" ]]; then
        echo "  python -c \"import apex, amp_C, fused_layer_norm_cuda; print('apex CUDA extensions OK')\""
    fi
    echo "  python pretrain_encoder.py --config examples/recipes/demo_tiny_biphasic.yaml --dry-run --world-size 8"
} >"$OUT/INSTALL.txt"

log "done: $WHEEL_COUNT wheels in $OUT; see $OUT/INSTALL.txt"
