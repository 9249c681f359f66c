#!/bin/bash
# Puts vLLM's two install parts (../shared/peers/vllm/part01, part02: wheel halves + dependency wheels, each
# under 48 MiB) into .vllm/part01 and .vllm/part02 of this checkout, where a GPU run can carry one at a time,
# and keeps .vllm/ out of git (.git/info/exclude). Idempotent: run it again at will.
#   bash bench/peers/prepare_vllm.sh [SHARED_VLLM_DIR]
# Then two back-to-back GPU runs (the machine's /tmp lasts ~30 s after a command; README "Benchmarks"):
#   1. carry .vllm/part01:  bash .vllm/part01/copy_part.sh
#   2. carry .vllm/part02:  bash .vllm/part02/copy_part.sh && bash .vllm/part02/device_install.sh && <bench>
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SRC="${1:-$ROOT/../shared/peers/vllm}"
[ -d "$SRC/part01" ] && [ -d "$SRC/part02" ] || { echo "no part01/part02 under $SRC" >&2; exit 1; }
for p in part01 part02; do
  mkdir -p "$ROOT/.vllm/$p"
  # -L: no hard links into the read-only shared folder; the copies get write permission so a rerun can overwrite
  cp -rL --no-preserve=mode "$SRC/$p/." "$ROOT/.vllm/$p/"
  chmod +x "$ROOT/.vllm/$p"/*.sh
done
EXCLUDE="$(git -C "$ROOT" rev-parse --git-path info/exclude)"
case "$EXCLUDE" in /*) ;; *) EXCLUDE="$ROOT/$EXCLUDE" ;; esac
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.vllm/' "$EXCLUDE" 2>/dev/null || echo '/.vllm/' >> "$EXCLUDE"
(cd "$ROOT/.vllm/part01" && sha256sum -c --quiet --ignore-missing MANIFEST.sha256)
(cd "$ROOT/.vllm/part02" && sha256sum -c --quiet --ignore-missing MANIFEST.sha256)
du -sh "$ROOT/.vllm/part01" "$ROOT/.vllm/part02"
echo "ready: carry .vllm/part01, then .vllm/part02 (git status ignores .vllm/)"
