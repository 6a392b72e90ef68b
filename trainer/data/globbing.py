"""Files matching a glob, found without following a link to a folder.

Python's `glob(recursive=True)` follows folder links under `**`: a link back up the tree (a loop)
makes it walk for ever. Here `**` walks with `os.walk(followlinks=False)` and never enters the
kernel's special filesystems; files reached through a link still match.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from pathlib import PurePath

# The kernel's filesystems: no data files, and some files never end.
SPECIAL_FILESYSTEMS = ("/proc", "/sys", "/dev")


def glob_files(pattern: str) -> list[str]:
    """The paths that `pattern` matches, sorted; `**` matches any number of folders, as glob's recursive mode."""
    return sorted(_walk(glob_root(pattern), pattern) if "**" in pattern else glob.glob(pattern))


def glob_root(pattern: str) -> str:
    """The part of `pattern` before its first component with a wildcard (the file's folder if none)."""
    parts = PurePath(pattern).parts
    fixed = [p for p in parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]]
    if len(fixed) == len(parts):  # a plain file name
        fixed = fixed[:-1]
    return str(PurePath(*fixed)) if fixed else "."


def _component_regex(part: str) -> str:
    """A regex for one path component of a glob and the `/` after it: `*` and `?` stay within the
    component, `[...]` as fnmatch, `**` any number of folders."""
    if part == "**":
        return "(?:[^/]*/)*"
    out, i = [], 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in part[i + 2:]:
            end = part.index("]", i + 2)
            body = part[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out) + "/"


def _walk(root: str, pattern: str) -> Iterator[str]:
    """The files under `root` that match the recursive glob `pattern`, in a walk that never follows a
    link to a folder (a link loop would be walked forever) and never enters the kernel's special
    filesystems; hidden files and folders (a leading dot) are left out unless the pattern names one,
    as glob does."""
    rest = PurePath(os.path.relpath(pattern, root) if root != "." else pattern).as_posix()
    *folders, last = rest.split("/")
    # The last component names the file: no "/" after it, and a last `**` matches any path.
    body = "".join(map(_component_regex, folders)) + (".*" if last == "**" else _component_regex(last)[:-1])
    regex = re.compile(body + r"\Z", re.S)
    hidden = "/." in "/" + rest
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if (hidden or not d.startswith("."))
                         and os.path.realpath(os.path.join(folder, d)) not in SPECIAL_FILESYSTEMS)
        for name in sorted(files):
            path = os.path.join(folder, name)
            rel = PurePath(os.path.relpath(path, root)).as_posix()
            if (hidden or not name.startswith(".")) and regex.match(rel):
                yield path
