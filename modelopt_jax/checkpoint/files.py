"""Opening checkpoint files without trusting what sits at their path.

A checkpoint directory is input: ``model.safetensors`` may be a FIFO (an open would block
forever), a device or a directory. Every checkpoint file is opened non-blocking, checked to be a
regular file on the open descriptor (no race between check and use), and only then read.
Symlinks are followed on purpose: the Hugging Face hub cache links snapshot files to blobs.
"""

from __future__ import annotations

import fcntl
import os
import stat

from modelopt_jax.errors import CheckpointError

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}


def open_regular(path: str, mode: str = "rb"):
    """``open(path, mode)`` for reading, refusing anything but a regular file with a CheckpointError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, without a writer
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            raise CheckpointError(f"{path}: not a regular file ({_KINDS.get(kind, 'a special file')}); "
                                  f"checkpoint files must be regular files")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise
