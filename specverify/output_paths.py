"""Checks of output paths (``--json``, ``--plot``, ``--csv``), run by every subcommand before any work.

Plain Python (no torch): ``specverify plan`` and ``specverify bench verify-wall`` both import it.
"""
from __future__ import annotations

import os


def output_path_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (one clause that names the fix), or None when it can.

    The rule every subcommand applies to its output flags (``--json``, ``--plot``, ``--csv``) before any work, so a
    long run never ends in a traceback at its last step: the path is not empty and not a directory, its parent
    directory exists and is writable, and an existing file there is writable.
    """
    if not path:
        return "the path is empty; name a file, e.g. out.json"
    if os.path.isdir(path):
        return f"{path} is a directory; name a file inside it, e.g. {os.path.join(path, 'out.json')}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        return f"directory {parent} does not exist; create it (mkdir -p {parent}) or choose another path"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory; choose another path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable; choose another path"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path} exists and is not writable; choose another path or make it writable"
    return None


def check_output_paths(paths: dict) -> None:
    """Raise ``ValueError`` for the first ``{flag: path}`` entry that cannot be written (None entries: flag not
    given), naming the flag, the path and the fix (:func:`output_path_problem`)."""
    for flag, path in paths.items():
        if path is None:
            continue
        problem = output_path_problem(path)
        if problem:
            raise ValueError(f"{flag} {path!r}: {problem}")
