"""Opening the files a checkpoint is made of as what they are: input anyone could have written.

Every file a command reads beside or inside a checkpoint (the ``.pt``, a sidecar, a sharded
folder's ``.metadata``, shards and ``state.pt``) is opened by ``open_checkpoint_file``: a
symbolic link is refused (``O_NOFOLLOW``), so is anything but a regular file (opened with
``O_NONBLOCK``, so that a FIFO cannot hang the open, then refused after ``fstat``), and so is a
file larger than what it can be (a sidecar: ``SIDECAR_MAX_BYTES``; a shard: the size its
sidecar committed), all before a byte is read or hashed. ``/dev/zero`` planted as a sidecar,
or a FIFO, ends in one reason instead of an endless read.

``check_stored_zip`` refuses a ``torch.save`` archive whose entries are compressed, or claim
more bytes than the archive holds: ``torch.save`` never compresses, and a deflated entry of
zeros unpacks to a thousand times its size when ``torch.load`` allocates it.

``CheckpointError`` is the one error every reader (and writer) of checkpoints raises.
"""

import io
import os
import stat
import zipfile
from pathlib import Path
from typing import BinaryIO


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified or loaded; ``path`` and ``reason`` say which
    and why. The recipe's command line exits 2 when a resume raises it, 4 when a save does."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason

# A sidecar is a few hundred bytes; a sharded one lists every file of its folder (about 150
# bytes a file): this holds over a thousand.
SIDECAR_MAX_BYTES = 256 * 2**10
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def open_checkpoint_file(path: Path, *, owner: Path, what: str,
                         max_bytes: int | None = None) -> BinaryIO:
    """``path`` opened for reading, checked to be a regular file (not a link) of at most
    ``max_bytes``. ``FileNotFoundError`` passes through (callers name what is missing); a
    refusal is ``CheckpointError(owner, ...)`` naming ``what``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError:
        if os.path.islink(path):
            raise CheckpointError(owner, f"refused: {what} is a symbolic link; a checkpoint's "
                                         "files are regular files of its own folder") from None
        raise
    try:
        facts = os.fstat(descriptor)
        if not stat.S_ISREG(facts.st_mode):
            kind = next((name for test, name in _KINDS if test(facts.st_mode)), "not a file")
            raise CheckpointError(owner, f"refused: {what} is {kind}, not a regular file")
        if max_bytes is not None and facts.st_size > max_bytes:
            raise CheckpointError(owner, f"refused: {what} is {facts.st_size} bytes, more than "
                                         f"the {max_bytes} it can be")
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_small_file(path: Path, *, owner: Path, what: str, max_bytes: int) -> bytes:
    """The bytes of a small checkpoint-side file, opened by ``open_checkpoint_file``."""
    with open_checkpoint_file(path, owner=owner, what=what, max_bytes=max_bytes) as stream:
        return stream.read(max_bytes + 1)


def check_stored_zip(stream: BinaryIO, *, size: int, owner: Path, what: str) -> None:
    """Refuse a zip archive (``torch.save``'s format) of ``size`` bytes whose entries are
    compressed or claim more bytes than it holds; the stream is left at its start."""
    try:
        with zipfile.ZipFile(stream) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as err:
        raise CheckpointError(owner, f"not a checkpoint: {what} is not a torch.save archive "
                                     f"({first_line(err)})") from None
    compressed = [entry.filename for entry in entries
                  if entry.compress_type != zipfile.ZIP_STORED
                  or entry.compress_size != entry.file_size]
    if compressed:
        raise CheckpointError(owner, f"refused: {what} holds compressed entries ({compressed[0]}"
                                     "); torch.save stores every entry as it is, and a "
                                     "compressed one can unpack to far more than its size")
    claimed = sum(entry.file_size for entry in entries)
    if claimed > size:
        raise CheckpointError(owner, f"refused: {what}'s entries claim {claimed} bytes, more "
                                     f"than the {size} it holds")
    stream.seek(0)


class FileWindow(io.RawIOBase):
    """``length`` bytes of ``stream`` from ``offset``, as a seekable file of its own (a
    sharded checkpoint's file holds one ``torch.save`` archive per entry, one after another)."""

    def __init__(self, stream: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + position)
        return self._position

    def readinto(self, buffer) -> int:  # noqa: ANN001 - a writable buffer (memoryview)
        count = max(0, min(len(buffer), self._length - self._position))
        if count == 0:
            return 0
        self._stream.seek(self._offset + self._position)
        data = self._stream.read(count)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def is_count(value: object) -> bool:
    """A whole number a checkpoint may hold for a size, an offset or a position: an ``int``
    (not a bool, not a float such as JSON's ``1e999``) in [0, 2**63)."""
    return type(value) is int and 0 <= value < 2**63


def first_line(err: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none: a reason is
    never empty."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
