#!/usr/bin/env bash
# Here (a machine with pip and network): fetch the GPU stack for the lent H100/H200 machine
# (Python 3.12, torch 2.11.0+cu130, no registry, 64 MiB per call) and cut it into call-sized chunks.
#   fbgemm-gpu 1.6.0 (the release paired with torch 2.11; built for CUDA 13: libcudart.so.13)
#   torchrec 1.6.1 (paired with fbgemm-gpu 1.6) and the pure-Python packages the image lacks.
# The 465 MB fbgemm wheel is slimmed to its sm_90 cubins (scripts/gpu/slim_wheel.py: 179 MB as a zip). Its
# files are then packed as two xz archives (xz's 64 MiB window finds what deflate's 32 KiB cannot: 65 MB in
# all, where the zip needed four 45 MB calls):
#   .gpu/c0/fbgemm_a.tar.xz  the TBE backward library alone (23 MB)
#   .gpu/c1/fbgemm_b.tar.xz  every other file of the wheel, its dist-info included (42 MB), and .gpu/c1/small/
#                            (the small wheels, 2 MB)
# Each call's part plus the working tree (about 11 MB) stays under the device tool's 64 MiB a call;
# scripts/gpu/install.sh unpacks them on the device. Usage: bash scripts/gpu/prepare.sh   (about 5 minutes)
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
work=${WORK:-/tmp/herald_gpu_stack}
mkdir -p "$work/big" "$work/slim" .gpu/small
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/big" fbgemm-gpu==1.6.0
python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/small torchrec==1.6.1 hydra-core==1.3.8 \
    omegaconf==2.3.0 iopath==0.1.9 tensordict==0.11.0 orjson "pyvers>=0.2,<0.3" importlib_metadata
python3 -m pip wheel -q --no-deps -w .gpu/small antlr4-python3-runtime==4.9.3   # an sdist on PyPI
python3 scripts/gpu/slim_wheel.py "$work"/big/fbgemm_gpu-1.6.0-*.whl "$work/slim" --keep 90
rm -rf .gpu/c0 .gpu/c1 .gpu/c2 .gpu/c3 "$work/tree"
mkdir -p .gpu/c0 .gpu/c1 "$work/tree"
unzip -q "$work"/slim/fbgemm_gpu-1.6.0-*.whl -d "$work/tree"   # the wheel's files as pip --target lays them out
big=fbgemm_gpu/fbgemm_gpu_tbe_training_backward.so
tar -C "$work/tree" -cf - "$big" | xz -9 -T2 > .gpu/c0/fbgemm_a.tar.xz
tar -C "$work/tree" -cf - --sort=name --exclude="./$big" . | xz -9 -T2 > .gpu/c1/fbgemm_b.tar.xz
mv .gpu/small .gpu/c1/small
ls -la .gpu/c*
