#!/usr/bin/env bash
# Build horovod 0.28.1 from PyPI against torch 2.13 (Gloo + PyTorch, no MPI/TF/MXNet).
# Horovod's CMake pins -std=c++14 but torch 2.13's headers need C++17: a tiny compiler
# wrapper rewrites the flag. pip's wheel cache makes a second install take seconds.
# Usage: scripts/install-horovod.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
py=${1:-.venv/bin/python}
if "$py" -c "import horovod.torch" 2>/dev/null; then exit 0; fi
"$py" -m pip install -q cmake packaging psutil pyyaml cloudpickle
wrap=$(mktemp -d)
real_cxx=$(command -v "${CXX:-g++}")
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
  "$py" -m pip install -q --no-build-isolation horovod==0.28.1
"$py" -c "import horovod.torch as hvd; assert hvd.gloo_built(), 'horovod built without gloo'"
