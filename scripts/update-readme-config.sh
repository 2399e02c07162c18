#!/usr/bin/env bash
# Rewrite README.md's configuration table from the code (build/tools/mplane-config --markdown).
set -euo pipefail
cd "$(dirname "$0")/.."
table=$(build/tools/mplane-config --markdown)
python3 - "$table" <<'PY'
import sys
table = sys.argv[1] + "\n"
s = open("README.md").read()
a, b = "<!-- config-table:begin -->\n", "<!-- config-table:end -->"
i, j = s.index(a) + len(a), s.index(b)
open("README.md", "w").write(s[:i] + table + s[j:])
PY
echo "README.md configuration table updated"
