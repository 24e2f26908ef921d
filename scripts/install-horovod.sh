#!/usr/bin/env bash
# Build Horovod 0.28.1 from PyPI against torch 2.13 (Gloo + PyTorch, no MPI/TF/MXNet).
# Every build tool is pinned by constraints.txt (CMake 3.x: CMake 4 refuses gloo's cmake_minimum_required).
# Horovod's CMake pins -std=c++14 but torch 2.13's headers need C++17: a tiny compiler wrapper rewrites the flag.
# pip's wheel cache makes a second install take seconds; a cold build took 4 min on two cores.
# Usage: scripts/install-horovod.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-.venv/bin/python}
if "$py" -c "import horovod.torch" 2>/dev/null; then exit 0; fi
fail() { echo "install-horovod: $*" >&2; exit 1; }
"$py" -c "import torch" 2>/dev/null || fail "torch is not installed in $py; run 'make venv' first"
real_cxx=$(command -v "${CXX:-g++}") || fail "no C++ compiler (${CXX:-g++}) on PATH; Horovod builds from source: install g++ (Debian/Ubuntu: apt install g++), or skip Horovod (grace_dgc runs on torch.distributed without it)"
export PIP_CONSTRAINT="$here/constraints.txt"
echo "install-horovod: building horovod==0.28.1 with $("$real_cxx" --version | head -n1) (a few minutes on a cold cache)" >&2
"$py" -m pip install -q cmake packaging psutil pyyaml cloudpickle wheel
wrap=$(mktemp -d)
trap 'rm -rf "$wrap"' EXIT
cat > "$wrap/c++17" <<WRAP
#!/usr/bin/env bash
args=()
for a in "\$@"; do [[ \$a == -std=c++14 ]] && a=-std=c++17; args+=("\$a"); done
exec "$real_cxx" "\${args[@]}"
WRAP
chmod +x "$wrap/c++17"
export PATH="$(dirname "$py"):$PATH"
CXX="$wrap/c++17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
  "$py" -m pip install -q --no-build-isolation horovod==0.28.1 \
  || fail "the Horovod build failed (output above); grace_dgc itself works without Horovod"
"$py" -c "import horovod.torch as hvd; assert hvd.gloo_built(), 'horovod built without gloo'"
