#!/usr/bin/env bash
# On the lent GPU machine: stage a chunk (bash scripts/gpu/install.sh stage), or, with the last chunk, finish the
# install into /tmp/site (bash scripts/gpu/install.sh install), then
#   export PYTHONPATH=/tmp/site:$PWD
# The chunks arrive as the carried paths of consecutive calls: .gpu/c0 with `stage`, then .gpu/c1 with `install`
# (scripts/gpu/prepare.sh makes them). One machine stays warm 30 s after a call, and what is staged under
# /root/stage and unpacked into /tmp/site survives while it does.
#
# Each call unpacks the fbgemm archives it brings in the background, in a process session of its own so that it
# outlives the call (Python's tarfile and lzma: no xz binary needed there). The first call also starts building
# herald's compiled extension (torchrec_herald/native, against the image's torch) the same way. The install
# waits for both, and runs once more, in its own call, a job that the machine stopped anyway (no rc line and no
# process left, or killed by a signal). Without the extension herald full's scheduler runs its Python references
# there (every GPU figure of herald full up to 2026-11-27 did: the CPU build in the tree is for another Python and
# torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /root/stage /tmp/site/fbgemm_gpu   # (the package folder made first: two archives unpack into it at once)
for c in .gpu/c*; do [ -d "$c" ] && cp -r "$c"/. /root/stage/; done
ls /root/stage
background() {  # background <log> <command...>: run detached, append rc=<status> to <log> when done
    local log=$1; shift
    printf '%s\n' "$*" > "$log.cmd"   # kept, so that waited() can run it again here if it was stopped
    setsid nohup bash -c "echo \$\$ > $log.pid; bash $log.cmd > $log 2>&1; echo rc=\$? >> $log" \
        < /dev/null > /dev/null 2>&1 &
}
if [ ! -e /root/native_build.started ] && [ -z "${NO_NATIVE:-}" ]; then
    touch /root/native_build.started
    background /root/native_build.log python3 -m torchrec_herald.native.build
fi
for a in /root/stage/fbgemm_*.tar.xz; do
    [ -e "$a" ] && [ ! -e "$a.started" ] || continue
    touch "$a.started"
    background "$a.log" python3 -c "\"import sys, tarfile; tarfile.open(sys.argv[1], 'r|xz').extractall('/tmp/site', filter='tar')\"" "$a"
done
[ "${1:-stage}" = install ] || exit 0
running() {  # running <log>: the background job of <log> is alive (no pid written yet: taken as running)
    kill -0 "$(cat "$1.pid" 2>/dev/null || echo 0)" 2>/dev/null
}
waited() {  # waited <log> <seconds>: wait for a background job's rc line; its last lines; fail unless rc=0
    local rc
    for _ in $(seq "$2"); do
        grep -q "^rc=" "$1" 2>/dev/null && break
        running "$1" || break
        sleep 1
    done
    rc=$(grep -o "^rc=[0-9]*" "$1" 2>/dev/null | tail -1 | cut -c4- || true)
    if { [ -z "$rc" ] && ! running "$1"; } || [ "${rc:-0}" -ge 128 ]; then
        # gone without its rc line, or killed by a signal (the machine ended it with a call): once more, here
        echo "install.sh: $(basename "$1" .log) was stopped (rc=${rc:-none}); running it again in this call"
        bash "$1.cmd" > "$1" 2>&1; echo "rc=$?" >> "$1"
    fi
    tail -2 "$1"; grep -q "^rc=0" "$1"
}
for part in a b; do
    a=/root/stage/fbgemm_$part.tar.xz
    [ -e "$a" ] || { echo "install.sh: $a is not staged: this machine did not get .gpu/c0 (a fresh one?); stage it again"; exit 1; }
    waited "$a.log" 180 || { echo "install.sh: unpacking $a failed"; exit 1; }
done
if [ -e /root/native_build.started ]; then  # the extension's build (at most 4 minutes); without it herald runs its Python references
    waited /root/native_build.log 240 || echo "install.sh: herald's extension did not build here (see above): its Python references run"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /root/stage/small/*.whl
PYTHONPATH=/tmp/site python3 -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, \
'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, torch.cuda.get_device_name(0))"
