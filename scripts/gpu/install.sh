#!/usr/bin/env bash
# On the lent GPU machine: stage one chunk (bash scripts/gpu/install.sh stage), or, after the last
# chunk, reassemble and install into /tmp/site (bash scripts/gpu/install.sh install), then
#   export PYTHONPATH=/tmp/site:$PWD
# Chunks arrive as the carried paths .gpu/c0, .gpu/c1, .gpu/c2, then .gpu/c3 (with the small wheels, and install) of
# consecutive calls (one machine stays warm 30 s after a call, and what is staged under /root/stage survives while it does).
#
# The first stage call also starts building herald's compiled extension (torchrec_herald/native, against the
# image's torch) in the background, in its own process session so that it outlives the call; the install
# waits for it. Without it herald full's scheduler runs its Python references there (every GPU figure of
# herald full up to 2026-11-27 did: the CPU build in the tree is for another Python and torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /root/stage
for c in .gpu/c*; do [ -d "$c" ] && cp -r "$c"/. /root/stage/; done
ls /root/stage
if [ ! -e /root/native_build.started ] && [ -z "${NO_NATIVE:-}" ]; then
    touch /root/native_build.started
    setsid nohup bash -c "python3 -m torchrec_herald.native.build > /root/native_build.log 2>&1; echo rc=\$? >> /root/native_build.log" \
        < /dev/null > /dev/null 2>&1 &
fi
[ "${1:-stage}" = install ] || exit 0
if [ -e /root/native_build.started ]; then  # wait for the extension's build (at most 4 minutes)
    for _ in $(seq 240); do grep -q "^rc=" /root/native_build.log 2>/dev/null && break; sleep 1; done
    tail -2 /root/native_build.log
fi
whl=/root/stage/fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl
cat $(ls /root/stage/fbgemm.part* | sort) > "$whl"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$whl" /root/stage/small/*.whl
PYTHONPATH=/tmp/site python3 -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, \
'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, torch.cuda.get_device_name(0))"
