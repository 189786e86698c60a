"""What the bubblewrap backend keeps on the host, under ``STATE_DIR``.

``STATE_DIR`` is ``etude-sandbox-UID`` in the system temp directory, private to the user (0700).

- ``private_etc``: the sandbox's ``/etc``, a copy of the world-readable host files that programs
  need (``ETC_FILES``, plus ``NETWORK_ETC_FILES`` with the network), content-addressed and built
  at most once per content; its ``nsswitch.conf`` answers users and groups from the files alone
  (``files_only_nsswitch``).
- Running as root: ``lease_uid`` leases an unprivileged uid of ``uid_range`` for one run (a lock
  file per uid), ``workspace_lock`` serializes the runs on one workspace (striped lock files) and
  ``chown_tree`` gives the workspace to the run's uid and back. The locks are ``flock``s: threads
  of one process exclude each other too, and a crashed holder releases them.

What this module does not do: build or run the ``bwrap`` command (``etude.sandbox.bwrap``), decide
which paths the sandbox shows, or remove the state directory (its ``/etc`` copies are reused by
later runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import random
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# What ordinary programs read from /etc: the dynamic loader, Debian alternatives (awk, editor...),
# user and host name lookup, locale and time zone, TLS roots. Not the rest (keys, configs). The
# sandbox gets copies of the world-readable ones.
ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/protocols",
    "/etc/services",
    "/etc/localtime",
    "/etc/mime.types",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
)
NETWORK_ETC_FILES = ("/etc/resolv.conf", "/etc/gai.conf")
NSS_FILES_ONLY = ("passwd", "group", "shadow", "gshadow")
"""Name-service databases the sandbox's ``nsswitch.conf`` answers from ``/etc`` alone."""
NSS_FILES_ONLY_VERSION = b"nss-files-only-1"
WORKSPACE_LOCK_STRIPES = 1024
STATE_DIR = Path(tempfile.gettempdir()) / f"etude-sandbox-{os.getuid()}"


def _copy_readable(src: str, dest: str) -> None:
    """Copy ``src`` to ``dest`` keeping symlinks as links and skipping what others cannot read."""
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dest)
    elif stat.S_ISDIR(st.st_mode):
        if st.st_mode & 0o005 != 0o005:
            return  # e.g. /etc/ssl/private
        os.mkdir(dest, 0o755)
        for name in sorted(os.listdir(src)):
            _copy_readable(os.path.join(src, name), os.path.join(dest, name))
    elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o004:
        shutil.copyfile(src, dest)
        os.chmod(dest, 0o644)


def _fingerprint(paths: Sequence[str]) -> str:
    """A hash of names, modes, sizes, times and link targets of everything ``private_etc`` copies."""
    h = hashlib.sha256()

    def add(path: str) -> None:
        st = os.lstat(path)
        link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
        h.update(f"{path}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{link}\n".encode())
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o005 == 0o005:
            for name in sorted(os.listdir(path)):
                add(os.path.join(path, name))

    h.update(NSS_FILES_ONLY_VERSION)  # what private_etc does to the copies
    for path in paths:
        if os.path.lexists(path):
            add(path)
    return h.hexdigest()[:24]


def files_only_nsswitch(text: str) -> str:
    """``nsswitch.conf`` with the user and group databases answered from the files alone.

    Host sources such as ``systemd`` (userdb) have no daemon in the sandbox: each lookup would
    only probe a dozen absent sockets and directories (``setpriv``'s uid lookup did 35 opens of
    them per command), at a cost every command and the provenance tracer pay.
    """
    out = []
    for line in text.splitlines():
        db = line.split(":", 1)[0].strip()
        out.append(f"{db}: files" if db in NSS_FILES_ONLY and ":" in line else line)
    return "\n".join(out) + "\n"


@functools.lru_cache(maxsize=4)
def private_etc(paths: tuple[str, ...]) -> Path:
    """A directory holding copies of the world-readable ``/etc`` entries in ``paths``.

    Content-addressed under the state directory and built at most once per content: one bind of
    it costs a tenth of binding each file (every mount is ~0.2 ms of bwrap start-up).
    """
    assert all(p.startswith("/etc/") for p in paths), paths
    STATE_DIR.mkdir(mode=0o700, exist_ok=True)
    target = STATE_DIR / f"etc-{_fingerprint(paths)}"
    if target.is_dir():
        return target
    staging = Path(tempfile.mkdtemp(prefix="etc-staging-", dir=STATE_DIR))
    os.chmod(staging, 0o755)
    for path in paths:
        if os.path.lexists(path):
            _copy_readable(path, str(staging / os.path.basename(path)))
    nss = staging / "nsswitch.conf"
    if nss.is_file() and not nss.is_symlink():
        nss.write_text(files_only_nsswitch(nss.read_text(errors="replace")))
    try:
        os.rename(staging, target)
    except OSError:  # another process built the same content first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give ``root`` and everything under it to ``uid:gid`` without following symlinks."""
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(dirpath, name), uid, gid)


@contextlib.contextmanager
def _flock(path: Path, *, blocking: bool) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path``; yields False when non-blocking and taken.

    flock locks belong to the open file, so threads of one process exclude each other too, and a
    crashed holder releases its locks with its file descriptors.
    """
    STATE_DIR.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            held = True
        except BlockingIOError:
            held = False
        yield held
    finally:
        os.close(fd)


@contextlib.contextmanager
def workspace_lock(ws: Path) -> Iterator[None]:
    """Serialize runs on ``ws`` (their chowns would interleave).

    Striped over a fixed set of lock files so that episodes do not leave one file each behind;
    two workspaces sharing a stripe only wait for each other.
    """
    stripe = int(hashlib.sha256(str(ws).encode()).hexdigest(), 16) % WORKSPACE_LOCK_STRIPES
    with _flock(STATE_DIR / f"workspace-{stripe}.lock", blocking=True):
        yield


@contextlib.contextmanager
def lease_uid(start: int, stop: int) -> Iterator[int]:
    """An unprivileged uid in [start, stop) that no other run on this host holds right now."""
    candidates = list(range(start, stop))
    offset = random.randrange(len(candidates))
    while True:
        for uid in candidates[offset:] + candidates[:offset]:
            with _flock(STATE_DIR / f"uid-{uid}.lock", blocking=False) as held:
                if held:
                    yield uid
                    return
        time.sleep(0.05)  # every uid of the range is in use: wait for a run to finish
