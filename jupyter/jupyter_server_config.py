"""Server settings of `make lab` and `make dashboard` (passed with --config).

The repository's notebooks are lecture material, re-run in class: JupyterLab saves them (and
autosaves them) WITHOUT outputs, so running them never changes a tracked file and `git status`
stays clean. Outputs are stripped with nbstripout's own function, the tool the repository also
installs as a git clean filter (scripts/install_nbfilter.sh) for edits made outside `make lab`.
Notebooks git does not track (your own) are saved as they are.
"""
import subprocess
from pathlib import Path


def strip_outputs_of_tracked_notebooks(model, path, contents_manager, **kwargs):
    """pre_save_hook: drop outputs and execution counts of a git-tracked notebook (cell ids kept)."""
    if model.get("type") != "notebook" or not model.get("content"):
        return
    full = Path(contents_manager.root_dir) / path
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", full.name], cwd=full.parent,
                             capture_output=True).returncode == 0
    if not tracked:
        return
    import nbformat
    from nbstripout import strip_output

    nb = nbformat.from_dict(model["content"])
    strip_output(nb, keep_output=False, keep_count=False, keep_id=True)
    model["content"] = nb


c = get_config()  # noqa: F821 - provided by Jupyter when it loads this file
c.FileContentsManager.pre_save_hook = strip_outputs_of_tracked_notebooks
