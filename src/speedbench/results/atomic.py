"""Output files written whole or not at all: a temp file beside the target, fsync, os.replace.

A crash, a full disk or Ctrl-C leaves either the old file or the new one, never a truncated
one. os.replace swaps the directory entry: a symbolic link at the destination is replaced by
the new file, its target is never written through. A stop signal's action is held while a
file is written (errors.signals_held): its KeyboardInterrupt cannot land between a temp file's
creation and its cleanup (which would leave it behind), nor halfway through an appended row;
it comes as soon as the write is done.

Every OSError of a write names the file it was writing (`exc.filename`, the target's path: a
write to a full disk's open descriptor names none, and a temp file's name is not one the user
knows), so that the run turns any of them into one line naming the file (run.py,
results.write_failed): trials.csv's, quality.csv's, explain.csv's, planned.json's alike.
"""
from __future__ import annotations

import contextlib
import csv
import io
import os
import tempfile
from pathlib import Path

from speedbench.errors import signals_held

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: mkstemp's files are 0600, output files get the usual mode


@contextlib.contextmanager
def naming(path):
    """An OSError raised inside names `path` (its errno and text kept: a full disk's ENOSPC is
    still one, a PermissionError still that)."""
    try:
        yield
    except OSError as exc:
        if exc.filename == os.fspath(path) and exc.filename2 is None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from exc


def temp_copy_of(path: Path, data: bytes) -> Path:
    """`data` in a synced temp file in path's directory; removed again if anything fails."""
    with naming(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with naming(path), os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _sync_dir(directory: Path) -> None:
    try:  # the rename itself survives a power cut only once the directory is synced
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_files(contents: dict) -> None:
    """Several files as one step: every temp file is written before any target is replaced,
    so that a full disk leaves all the old files (or none), never half of a new set."""
    temps = {}
    with signals_held():
        try:
            for path, data in contents.items():
                temps[Path(path)] = temp_copy_of(Path(path), data)
            for path, tmp in temps.items():
                with naming(path):
                    os.replace(tmp, path)
        finally:
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)  # left only when something failed
    for directory in {p.parent for p in temps}:
        _sync_dir(directory)


def append_text(path, text: str) -> None:
    """`text` appended whole or not at all: a failed write (a full disk) is cut back off, so
    that the file never ends in half a line."""
    data = memoryview(text.encode("utf-8"))
    with signals_held(), naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            os.ftruncate(fd, end)
            raise
        finally:
            os.close(fd)


def write_bytes(path, data: bytes) -> Path:
    write_files({path: data})
    return Path(path)


def write_text(path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_csv(frame, path, **kwargs) -> Path:
    """A DataFrame as CSV (to_csv's keyword arguments; index=False unless given)."""
    kwargs.setdefault("index", False)
    return write_text(path, frame.to_csv(**kwargs))


def save_figure(fig, path, **kwargs) -> Path:
    """A matplotlib figure as PNG (savefig's keyword arguments)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **kwargs)
    return write_bytes(path, buffer.getvalue())


def real_dir(path) -> Path:
    """`path` as a directory of its own: a symbolic link there is replaced (its target left
    alone), so that files written or removed inside stay inside."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def append_rows(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Whole CSV lines appended (the header first when the file is new); a key a row lacks is
    left empty, one not in `columns` is ignored."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    new = not path.exists()
    if new:
        w.writeheader()
    w.writerows({k: r.get(k, "") for k in columns} for r in rows)
    if new:
        write_text(path, buf.getvalue())
    elif rows:
        append_text(path, buf.getvalue())
