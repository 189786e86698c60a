"""The paths of the directories a recorded command's events name by handle.

Group A's events (``etude.sandbox.recorder``) name a file by its directory's handle (the file
system's id and a ``name_to_handle_at`` handle) and its name in that directory. ``DirPaths``
turns a handle into the path the sandbox saw, one command's:

- a cache of handle -> path, filled before the command for every workspace directory
  (``etude.sandbox.gate.mark_workspace``) and as directories the command makes are reported;
  kept right through renames of directories (``moved``), so a path is the one the directory had
  at the event even when the command renames or removes it afterwards;
- a handle the cache does not know is opened through a descriptor of its file system
  (``mount_fds``, one per file system, from ``etude.sandbox.gate.mark_mounts``) and its host
  path mapped to the sandbox's (``host_roots``: the sandbox's private ``/etc``). Directories of
  the host's read-only binds are kept for the next command (``dir_cache``, at most
  ``MAX_DIRS``);
- hard links made in the workspace (``maybe_link``): their other names count as read and
  written, found in one walk of the workspace at the end (``link_sources``).

What it does not do: read events, or decide what an event means for the record (the recorder
does); a directory removed before its event was read has no path (the event is dropped).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import time
from collections.abc import Sequence

from etude.sandbox.fanotify import DIR_EVENTS, FAN_MARK_INODE, fanotify_mark, handle_path
from etude.sandbox.gate import MAX_DIRS, host_fs
from etude.sandbox.provenance import RecordBuilder


class DirPaths:
    """Directory handle (fsid + file handle) -> the path the sandbox sees, for one command.

    ``group_a``: the group whose inode marks watch the workspace's directories (a directory the
    command makes is marked as its creation is read). ``workspace``: the workspace's path (no
    trailing slash). ``host_roots``: ``(host path, sandbox path)`` of binds whose source lies
    elsewhere on the host. ``dir_cache``: the paths of directories on the read-only binds, by
    handle, kept by the sandbox from command to command (read here, and added to).
    """

    def __init__(
        self,
        *,
        group_a: int,
        workspace: str,
        host_roots: Sequence[tuple[str, str]],
        dir_cache: dict[bytes, str],
    ) -> None:
        self.group_a = group_a
        self.workspace = workspace
        self.host_roots = [(h.rstrip("/"), s.rstrip("/")) for h, s in host_roots]
        self._dir_cache = dir_cache
        self.dirs: dict[bytes, str] = dict(dir_cache)
        """fsid + handle of a directory -> its path."""
        self.mount_fds: dict[bytes, int] = {}
        """fsid -> a directory on that file system (to open its handles)."""
        self.links: dict[tuple[int, int], set[str]] = {}
        """(device, inode) of files the command linked in the workspace -> the names it made."""

    def join(self, handle: bytes, name: bytes) -> str | None:
        """The path of entry ``name`` of the directory ``handle`` (the directory for ``.``)."""
        base = self.dirs.get(handle) or self.resolve(handle)
        if base is None:
            return None
        return base if name in (b".", b"") else posixpath.join(base, os.fsdecode(name))

    def resolve(self, handle: bytes) -> str | None:
        """The path of a directory the cache does not know yet, as the sandbox sees it."""
        mount_fd = self.mount_fds.get(handle[:8])
        path = handle_path(mount_fd, handle) if mount_fd is not None else None
        if path is None or not path.startswith("/"):
            return None  # removed before its event was read
        # a host file system opens at its host path (the binds keep their paths but /etc's);
        # one of the sandbox alone (its /tmp) at the path the sandbox sees
        self.dirs[handle] = path = self.sandbox_path(path)
        if (
            handle[:8] == host_fs()[1]
            and not (path == self.workspace or path.startswith(self.workspace + "/"))
            and len(self._dir_cache) < MAX_DIRS
        ):
            self._dir_cache[handle] = path  # a read-only bind's: the same in the next command
        return path

    def sandbox_path(self, path: str) -> str:
        """A host path as the sandbox sees it (``host_roots``)."""
        for host, sandbox in self.host_roots:
            if path == host or path.startswith(host + "/"):
                return sandbox + path[len(host) :]
        return path

    def new_dir(self, path: str, child: bytes) -> None:
        """A directory made by the command: watch it for what is made or removed in it."""
        if child:
            self.dirs[child] = path
        with contextlib.suppress(OSError):
            if path.startswith(self.workspace + "/"):
                fanotify_mark(self.group_a, FAN_MARK_INODE, DIR_EVENTS, path)

    def moved(self, src: str, dst: str) -> None:
        """A directory renamed from ``src`` to ``dst``: the paths of it and all under it."""
        for handle, path in list(self.dirs.items()):
            if path == src or path.startswith(src + "/"):
                self.dirs[handle] = dst + path[len(src) :]

    def maybe_link(self, path: str) -> None:
        """A new name of an existing workspace file (a hard link; they cannot cross mounts, so
        the source is in the workspace too): its other names count as read and written, as with
        strace. Its inode is noted here; the names are found by ``link_sources``, one walk of
        the workspace for all links (a walk per link would let a flood of links stall the
        reader)."""
        try:
            st = os.lstat(path)
        except OSError:
            return
        if st.st_nlink >= 2 and path.startswith(self.workspace + "/"):
            self.links.setdefault((st.st_dev, st.st_ino), set()).add(path)

    def link_sources(self, builder: RecordBuilder, until: float) -> bool:
        """The other names of the linked files (``maybe_link``) as read and written in
        ``builder``; False when the walk ran past ``until``."""
        num = 0
        for dirpath, _, filenames in os.walk(self.workspace):
            for name in filenames:
                num += 1
                if num & 255 == 0 and time.monotonic() > until:
                    return False
                other = os.path.join(dirpath, name)
                try:
                    st = os.lstat(other)
                except OSError:
                    continue
                made = self.links.get((st.st_dev, st.st_ino))
                if made is not None and (other not in made or len(made) > 1):
                    builder.add("read", other)
                    builder.add("written", other)
        return True
