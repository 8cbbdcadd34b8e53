#!/usr/bin/env bash
# Build SageAttention2's sm90 kernels from its public source, for the side-by-side benchmark (device machine).
# The source is fetched by the developer into the ignored folder .sage/ (setup.py, sageattention/, csrc/ of
# github:thu-ml/SageAttention) and carried with the call; nothing of it is committed. With $1 = a folder,
# the built extension modules are copied there (e.g. $OUT, to carry them to later calls in .sage/).
set -euo pipefail
cd "$(dirname "$0")/../.sage"
if ! ls sageattention/_qattn_sm90*.so >/dev/null 2>&1; then
  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >build.log 2>&1 \
    || { tail -30 build.log; exit 1; }
fi
ls -la sageattention/*.so
[ -n "${1:-}" ] && cp sageattention/*.so "$1"/
python3 -c "import sys; sys.path.insert(0, '.'); from sageattention import sageattn_qk_int8_pv_fp8_cuda; print('sageattention built')"
