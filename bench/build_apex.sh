#!/usr/bin/env bash
# Build NVIDIA apex (C++ + CUDA extensions, sm_90) from the vendored tarball on the GPU machine and
# install it into a site folder (a few minutes on 16 cores, a ~43 MB wheel).
#   usage (on the GPU machine, tarball copied there): bench/build_apex.sh path/to/apex-6424da3.tar.gz [wheel_dir] [site_dir]
# Then: export PYTHONPATH=SITE_DIR:$PYTHONPATH; python3 -c 'import apex.optimizers, fused_layer_norm_cuda'
set -euo pipefail
tarball=${1:?apex tarball}; wheels=${2:-$PWD/apex-wheel}; site=${3:-$PWD/apex-site}
work=$(mktemp -d); mkdir -p "$wheels" "$site"
tar -xzf "$tarball" -C "$work"
src=$(find "$work" -maxdepth 2 -name setup.py -printf '%h\n' | head -1)
export TORCH_CUDA_ARCH_LIST=9.0 APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD=${APEX_PARALLEL_BUILD:-16} MAX_JOBS=${MAX_JOBS:-16}
t0=$(date +%s)
(cd "$src" && python3 -m pip wheel -q --no-build-isolation --no-deps -w "$wheels" .)
python3 -m pip install -q --no-index --no-deps --target "$site" "$wheels"/apex-*.whl
echo "build_apex: $(( $(date +%s) - t0 )) s, wheel $(du -h "$wheels"/apex-*.whl | cut -f1)"
PYTHONPATH=$site:${PYTHONPATH:-} python3 -c 'import apex.optimizers, fused_layer_norm_cuda, amp_C; print("build_apex: apex importable with its CUDA extensions")'
