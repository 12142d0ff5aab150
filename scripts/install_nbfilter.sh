#!/usr/bin/env bash
# Committed notebooks stay output-free after people run them: nbstripout as a git clean filter
# (usage: scripts/install_nbfilter.sh PYTHON). The filter cleans what git stores and compares, so
# `git status` stays clean while your working copy keeps its outputs. Cell ids are kept (JupyterLab
# keeps them stable); `required=false`: if the venv is removed, git keeps working (unfiltered).
set -euo pipefail
py=${1:?usage: scripts/install_nbfilter.sh PYTHON}
git rev-parse --git-dir >/dev/null 2>&1 || exit 0   # not a git checkout (an unpacked archive): nothing to do
"$py" -m nbstripout --install --attributes .gitattributes
# language_info beyond its name is what the kernel reports (its Python version, lexer...): JupyterLab writes it
# into the notebook on its first (auto)save, so without these keys a notebook open for 2 minutes showed as modified
info="metadata.language_info"
extra="$info.codemirror_mode $info.file_extension $info.mimetype $info.nbconvert_exporter $info.pygments_lexer $info.version"
git config filter.nbstripout.clean "'$(cd "$(dirname "$py")" && pwd)/$(basename "$py")' -m nbstripout --keep-id --extra-keys '$extra'"
git config filter.nbstripout.required false
git config diff.ipynb.textconv "'$(cd "$(dirname "$py")" && pwd)/$(basename "$py")' -m nbstripout -t --extra-keys '$extra'"
