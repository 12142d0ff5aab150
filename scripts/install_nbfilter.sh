#!/usr/bin/env bash
# Committed notebooks stay output-free after people run them: nbstripout as a git clean filter
# (usage: scripts/install_nbfilter.sh PYTHON). The filter cleans what git stores and compares, so
# `git status` stays clean while your working copy keeps its outputs. Cell ids are kept (JupyterLab
# keeps them stable); `required=false`: if the venv is removed, git keeps working (unfiltered).
set -euo pipefail
py=${1:?usage: scripts/install_nbfilter.sh PYTHON}
git rev-parse --git-dir >/dev/null 2>&1 || exit 0   # not a git checkout (an unpacked archive): nothing to do
"$py" -m nbstripout --install --attributes .gitattributes
git config filter.nbstripout.clean "'$(cd "$(dirname "$py")" && pwd)/$(basename "$py")' -m nbstripout --keep-id"
git config filter.nbstripout.required false
