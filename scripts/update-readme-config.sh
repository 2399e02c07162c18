#!/usr/bin/env bash
# Rewrite README.md's configuration table from the code (BUILD/tools/mplane-config --markdown).
#   scripts/update-readme-config.sh [BUILD]     BUILD: a build folder (from the repository's root, or absolute); build/ if not given
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
table=$("$build/tools/mplane-config" --markdown)
python3 - "$table" <<'PY'
import sys
table = sys.argv[1] + "\n"
s = open("README.md").read()
a, b = "<!-- config-table:begin -->\n", "<!-- config-table:end -->"
i, j = s.index(a) + len(a), s.index(b)
open("README.md", "w").write(s[:i] + table + s[j:])
PY
echo "README.md configuration table updated"
