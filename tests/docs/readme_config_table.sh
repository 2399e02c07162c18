#!/usr/bin/env bash
# The README's configuration table must be exactly what the code parses (mplane-config --markdown).
# On a mismatch, regenerate it: scripts/update-readme-config.sh
set -euo pipefail
tool="$1"; readme="$2"
want=$("$tool" --markdown)
have=$(sed -n '/<!-- config-table:begin -->/,/<!-- config-table:end -->/p' "$readme" | sed '1d;$d')
if [ "$want" != "$have" ]; then
  echo "README.md's configuration table differs from mplane-config --markdown:"
  diff <(echo "$have") <(echo "$want") || true
  echo "run scripts/update-readme-config.sh"
  exit 1
fi
echo "README configuration table matches the code ($(echo "$want" | grep -c MPLANE_) variables)"
