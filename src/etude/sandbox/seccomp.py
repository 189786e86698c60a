"""The bubblewrap sandbox's seccomp filter: io_uring is refused.

An operation submitted through io_uring (an ``IORING_OP_OPENAT``, a read, an unlink) is carried
out by the kernel on the ring's behalf, not by a system call of the process, so a tracer of
system calls (``etude.sandbox.provenance``) never sees it: a command could read a hidden cache
through a ring and leave no record. The sandbox therefore refuses the three io_uring calls
(``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``) with ``ENOSYS``, the answer of a
kernel built without io_uring, so programs that probe for it fall back to ordinary calls.

The filter is a classic BPF program written out here (no libseccomp needed), handed to
``bwrap --seccomp FD`` and applied to the sandbox's first program and everything it starts
(seccomp filters are inherited and cannot be removed). It matches the numbers 425-427, which
io_uring has on every architecture with the shared system-call table (x86-64, i386, arm64, arm,
riscv, s390, powerpc); the x32 flag bit (``0x40000000``) is cleared before the comparison, so the
x32 spelling of the same calls is refused too.

What it does not do: refuse anything else (the namespaces and the dropped uid do the rest of the
sandbox's work); cover architectures with their own numbering (alpha, mips, ia64).
"""

from __future__ import annotations

import errno
import os
import struct

IO_URING_SYSCALLS = (425, 426, 427)
"""io_uring_setup, io_uring_enter, io_uring_register."""
X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes (linux/filter.h, linux/seccomp.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_ALU_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
_NR_OFFSET = 0  # offsetof(struct seccomp_data, nr)


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program() -> bytes:
    """The filter as the array of ``struct sock_filter`` that ``bwrap --seccomp`` reads."""
    n = len(IO_URING_SYSCALLS)
    prog = [
        _insn(_LD_W_ABS, _NR_OFFSET),
        _insn(_ALU_AND_K, ~X32_SYSCALL_BIT & 0xFFFFFFFF),
    ]
    for i, nr in enumerate(IO_URING_SYSCALLS):
        # on a match jump over the remaining comparisons and the ALLOW to the ERRNO return
        prog.append(_insn(_JEQ_K, nr, jt=n - i, jf=0))
    prog.append(_insn(_RET_K, SECCOMP_RET_ALLOW))
    prog.append(_insn(_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS))
    return b"".join(prog)


def filter_fd() -> int:
    """A fresh file descriptor holding ``filter_program()``, read from its start (bwrap reads
    it to the end, so every run needs its own). The caller closes it."""
    fd = os.memfd_create("etude-seccomp", os.MFD_CLOEXEC)
    os.write(fd, filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
