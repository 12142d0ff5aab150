"""Server settings of `make lab` and `make dashboard` (passed with --config).

The repository's notebooks are lecture material, re-run in class: JupyterLab saves them (and
autosaves them) WITHOUT outputs, so running them never changes a tracked file and `git status`
stays clean. Outputs are stripped with nbstripout's own function, the tool the repository also
installs as a git clean filter (scripts/install_nbfilter.sh) for edits made outside `make lab`.
Notebooks git does not track (your own) are saved as they are.
"""
import subprocess
from pathlib import Path

# what the kernel reports about its language beyond the name (Python version, lexer, ...): JupyterLab writes it
# into the notebook once a kernel is connected, so a notebook autosaved after 2 minutes of running differed from
# the committed one (seen as a modified 02/05/07/08 in the browser test on a busy machine). The git clean filter
# drops the same keys (scripts/install_nbfilter.sh).
KERNEL_LANGUAGE_KEYS = [f"metadata.language_info.{k}" for k in
                        ("codemirror_mode", "file_extension", "mimetype", "nbconvert_exporter", "pygments_lexer",
                         "version")]


def strip_outputs_of_tracked_notebooks(model, path, contents_manager, **kwargs):
    """pre_save_hook: drop outputs, execution counts and the kernel's language details of a git-tracked
    notebook (cell ids kept)."""
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
    strip_output(nb, keep_output=False, keep_count=False, keep_id=True, extra_keys=KERNEL_LANGUAGE_KEYS)
    model["content"] = nb


c = get_config()  # noqa: F821 - provided by Jupyter when it loads this file
c.FileContentsManager.pre_save_hook = strip_outputs_of_tracked_notebooks
