"""Where the baseline's two model-sized vectors wait while the splits run: a temporary file on disk.

Every split is compared with the baseline's accumulated gradient and its parameters after the step, read
back chunk by chunk (``os.pread``: the chunk is copied into a small buffer, nothing is mapped), so no
process — neither the diagnosing one nor a forked data-parallel worker — holds them in its memory. The
kernel may keep the file's pages in its page cache, which it reclaims under pressure. A temporary
directory on a memory file system (tmpfs) would be memory after all: there the vectors stay in this
process's memory instead, where they are counted as such.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import Tensor

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_of(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts; "" if unknown)."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3:
                    mount = fields[1]
                    inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                    if inside and len(mount) >= len(best):
                        best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def spills_to_disk(directory: str | None = None) -> bool:
    """Whether the temporary directory is on disk (Linux; elsewhere the vectors stay in memory)."""
    kind = filesystem_of(directory or tempfile.gettempdir())
    return bool(kind) and kind not in MEMORY_FILESYSTEMS


class FlatStore:
    """Named flat vectors of ``numel`` elements of ``dtype``, written and read back by element range."""

    def __init__(self, names: tuple[str, ...], numel: int, dtype: torch.dtype, *, on_disk: bool | None = None):
        self.numel, self.dtype = numel, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.on_disk = spills_to_disk() if on_disk is None else on_disk
        self._slot = {name: i for i, name in enumerate(names)}
        self._file = None
        self._memory: dict[str, Tensor] = {}
        if self.on_disk:
            self._file = tempfile.TemporaryFile(prefix="splitproof-baseline-")  # unlinked: gone once closed
            self._file.truncate(len(names) * numel * self.itemsize)
        else:
            self._memory = {name: torch.empty(numel, dtype=dtype) for name in names}

    def _position(self, name: str, start: int) -> int:
        return (self._slot[name] * self.numel + start) * self.itemsize

    def write(self, name: str, start: int, values: Tensor) -> None:
        values = values.detach().reshape(-1).to(device="cpu", dtype=self.dtype)
        if not self.on_disk:
            self._memory[name][start : start + values.numel()] = values
            return
        data = values.contiguous().view(torch.uint8).numpy()
        written, position = 0, self._position(name, start)
        while written < data.nbytes:
            written += os.pwrite(self._file.fileno(), data[written:], position + written)

    def read(self, name: str, start: int, count: int) -> Tensor:
        if not self.on_disk:
            return self._memory[name][start : start + count]
        size, position = count * self.itemsize, self._position(name, start)
        buffer = bytearray()
        while len(buffer) < size:
            chunk = os.pread(self._file.fileno(), size - len(buffer), position + len(buffer))
            if not chunk:
                raise EOFError(f"baseline store: {name}[{start}:{start + count}] is past the end of the file")
            buffer += chunk
        return torch.frombuffer(buffer, dtype=self.dtype)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._memory = {}

    def __del__(self) -> None:
        self.close()
