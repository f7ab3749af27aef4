"""A container's first moments, run by the agent as
`nsenter --net=<pod netns> unshare --mount --propagation private python podinit.py PLAN.json`:
bind the pod's mounts in this private mount namespace, then exec the container's command.

A mount point missing on this machine (e.g. /opt/dsv4/models/tiny, /etc/dsv4) is created on an
overlay over its nearest existing ancestor, inside this namespace only: the host's files stay as
they are, as an image's would.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(
    source: str, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None
) -> None:
    """mount(2) in this process (a `mount` child could not see this process's /proc/self/fd)."""
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _ensure(target: str, is_dir: bool, overlays: list[str], scratch: str) -> None:
    if os.path.lexists(target):
        return
    ancestor = os.path.dirname(target)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not any(ancestor == o or ancestor.startswith(f"{o}/") for o in overlays):
        # Writable only here: the upper and work dirs live in the pod's directory.
        n = len(overlays)
        upper, work = f"{scratch}/{n}/upper", f"{scratch}/{n}/work"
        os.makedirs(upper)
        os.makedirs(work)
        _mount("overlay", ancestor, "overlay", 0, f"lowerdir={ancestor},upperdir={upper},workdir={work}")
        overlays.append(ancestor)
    if is_dir:
        os.makedirs(target)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()


def main(plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    # Parents before children; realpath so /var/run/... lands on /run/... as the kernel would.
    todo = sorted(plan["mounts"], key=lambda m: os.path.realpath(m["target"]).count("/"))
    # Sources are opened before anything is mounted: a volume over /tmp would hide the pod's own
    # directory (and the test's checkpoint) if they live under /tmp.
    sources = [os.open(m["source"], os.O_PATH) for m in todo]
    keep = [(p, os.open(p, os.O_PATH)) for p in plan.get("keep", []) if os.path.isdir(p)]
    overlays: list[str] = []
    for m in todo:  # every mount point first, while the scratch directory is still visible
        _ensure(os.path.realpath(m["target"]), os.path.isdir(m["source"]), overlays, plan["scratch"])
    for m, fd in zip(todo, sources, strict=True):
        target = os.path.realpath(m["target"])
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        if m["readOnly"]:
            _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    targets = [os.path.realpath(m["target"]) for m in todo]
    for path, fd in keep:  # the image's own files, where a volume went over a parent of them
        if any(path.startswith(f"{t}/") for t in targets):
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    for fd in [*sources, *(fd for _, fd in keep)]:
        os.close(fd)
    os.chdir(plan.get("workingDir") or "/")
    argv = plan["argv"]
    os.execvpe(argv[0], argv, plan["env"])


if __name__ == "__main__":
    main(sys.argv[1])
