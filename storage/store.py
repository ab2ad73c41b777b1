"""`ObjectStore`: one small API over local disk, memory, S3 and GCS.

Pools on different machines trade files only through this class, so it promises the same
behaviour everywhere: paths are relative and validated, a single object appears to readers
whole or not at all, every call retries transient faults the same way, and every error names
the full URI of the object it concerns. Missing objects raise `ObjectNotFoundError`, which is
also a `FileNotFoundError`.
"""

from __future__ import annotations

import builtins
import copy
import errno
import functools
import io
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import IO, Any, Protocol, TypeVar, cast

from storage.backends import Backend, open_backend
from storage.errors import is_missing_object
from storage.paths import clean_path
from storage.retry import RetryPolicy

Bytes = bytes | bytearray | memoryview
T = TypeVar("T")


class ChunkObserver(Protocol):
    """What `download_file` feeds each chunk to as it passes (a hasher, say)."""

    def update(self, data: memoryview, /) -> object: ...


# Prefix of the temporary files that make local writes atomic; listings hide them, so a writer
# that died mid-write leaves nothing a reader would mistake for data.
TMP_PREFIX = ".primeflow-tmp-"


def _replace_atomically(target: str, fill: Callable[[str], object]) -> None:
    """Create local file `target` via a temporary sibling and `os.replace`.

    `fill` writes the temporary file at the path it is given; what it returns is ignored.

    Readers see the old file or the complete new one, never a partial write, because a
    rename within one folder is atomic.
    """
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{TMP_PREFIX}{os.path.basename(target)}.{uuid.uuid4().hex}")
    try:
        fill(tmp)
        os.replace(tmp, target)
    except BaseException:
        with suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _write_file(path: str, data: Bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


# Chunk of a copy that observes its bytes: small enough to stay in the CPU cache between the
# read, the observer and the write on local disk.
_LOCAL_CHUNK = 2**20
_REMOTE_CHUNK = 8 * 2**20


def _copy_observed(source: io.FileIO, target: str, observer: ChunkObserver, chunk: int) -> None:
    """Copy local file `source` into the new file `target`, feeding each chunk to `observer`."""
    buffer = memoryview(bytearray(chunk))
    with open(target, "wb") as out:
        while count := source.readinto(buffer):
            piece = buffer[:count]
            observer.update(piece)
            out.write(piece)


def _observe_file(path: str, observer: ChunkObserver, chunk: int) -> None:
    """Feed local file `path` to `observer`, chunk by chunk."""
    buffer = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as source:
        while count := source.readinto(buffer):
            observer.update(buffer[:count])


def _is_hidden(path: str) -> bool:
    return path.rsplit("/", 1)[-1].startswith(TMP_PREFIX)


class ObjectStore:
    """Objects below a root URI: `file://`, bare local paths, `memory://`, `s3://`, `gs://`.

    S3 settings: the endpoint comes from `endpoint_url`, `AWS_ENDPOINT_URL_S3` or
    `AWS_ENDPOINT_URL`, addressing is path-style, and `region` is handed to botocore.
    Credentials are never passed in: they come from the environment or the standard AWS/Google
    chains, so no store holds or prints them.
    """

    def __init__(
        self,
        root_uri: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._settings: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "region": region,
            "retries": retries,
            "backoff_s": backoff_s,
            "storage_options": storage_options,
        }
        self._backend = open_backend(
            root_uri, endpoint_url=endpoint_url, region=region, storage_options=storage_options
        )
        self._policy = RetryPolicy(retries=retries, backoff_s=backoff_s)

    def __reduce__(self) -> tuple[Callable[..., ObjectStore], tuple[str]]:
        # Reopen from the settings rather than pickling the filesystem, whose tuning
        # (s3fs retries) would not survive the trip; settings never hold credentials.
        return functools.partial(ObjectStore, **self._settings), (self.url(),)

    def __repr__(self) -> str:
        endpoint = self._settings["endpoint_url"]
        return f"ObjectStore({self.url()!r}{f', endpoint_url={endpoint!r}' if endpoint else ''})"

    @property
    def protocol(self) -> str:
        """`file`, `memory`, `s3` or `gs`."""
        return self._backend.protocol

    def url(self, path: str = "") -> str:
        """The full URI of `path` (the root itself by default)."""
        return self._backend.url(clean_path(path))

    def child(self, path: str) -> ObjectStore:
        """A store rooted at `path` below this one, sharing its settings and connections."""
        sub = clean_path(path, allow_empty=False)
        store = copy.copy(self)
        store._backend = Backend(self._backend.fs, self.protocol, self._backend.full_path(sub))
        return store

    def _call(self, path: str, fn: Callable[[str], T], *, writing: bool = False) -> T:
        """Run `fn(full_path)` under the retry policy, with errors naming `path`'s URI."""
        clean = clean_path(path)
        return self._policy.call(
            self._backend.url(clean), lambda: fn(self._backend.full_path(clean)), writing=writing
        )

    def write_bytes(self, path: str, data: Bytes) -> None:
        """Write one object; readers see the previous version or this one, never a mix."""
        clean_path(path, allow_empty=False)
        if self._backend.is_local:
            self._call(
                path,
                lambda full: _replace_atomically(full, lambda tmp: _write_file(tmp, data)),
                writing=True,
            )
        else:
            # botocore and gcsfs take bytes, not arbitrary buffers; the network dwarfs the copy.
            payload = data if isinstance(data, bytes | bytearray) else bytes(data)
            self._call(path, lambda full: self._backend.fs.pipe_file(full, payload), writing=True)

    def write_stream(self, path: str, fill: Callable[[IO[bytes]], T]) -> T:
        """Write one object by streaming into it: `fill(handle)` writes the bytes; its result is
        returned. Readers see the previous version or the complete new one, as with `write_bytes`.

        On local disk `fill` writes straight into the temporary file that is renamed into place.
        On S3 and GCS it writes into a local temporary file that is then uploaded in one call:
        s3fs sends a large file as a multipart upload with `max_concurrency` (10) parts in
        flight, where its buffered file object sends one part at a time, and aborts the upload
        when a part fails; a failed `fill` uploads nothing. `memory://` buffers and puts once. A
        transient fault repeats the whole write, calling `fill` again from the start, so `fill`
        must be repeatable (and start any running state, such as a hash, afresh).
        """
        clean_path(path, allow_empty=False)
        fs = self._backend.fs

        def local(full: str) -> T:
            result: list[T] = []

            def into(tmp: str) -> None:
                with open(tmp, "wb") as handle:
                    result.append(fill(handle))

            _replace_atomically(full, into)
            return result[0]

        def buffered(full: str) -> T:
            handle = io.BytesIO()
            result = fill(handle)
            fs.pipe_file(full, handle.getvalue())
            return result

        def remote(full: str) -> T:
            with tempfile.TemporaryDirectory(prefix=TMP_PREFIX) as folder:
                spool = os.path.join(folder, "object")
                with open(spool, "wb") as handle:
                    result = fill(handle)
                fs.put_file(spool, full)
            return result

        if self._backend.is_local:
            attempt = local
        elif self.protocol == "memory":
            attempt = buffered
        else:
            attempt = remote
        return self._call(path, attempt, writing=True)

    def read_bytes(self, path: str) -> bytes:
        """The whole object."""
        return cast(bytes, self._call(path, lambda full: self._backend.fs.cat_file(full)))

    def open_input(self, path: str) -> IO[bytes]:
        """A readable binary stream over the object, for reading it in pieces; close it after.

        Only opening is retried: a fault while reading surfaces as the backend raised it.
        """
        return cast(IO[bytes], self._call(path, lambda full: self._backend.fs.open(full, "rb")))

    def exists(self, path: str) -> bool:
        """True when `path` is an object or a non-empty prefix."""
        return cast(bool, self._call(path, lambda full: self._backend.fs.exists(full)))

    def size(self, path: str) -> int:
        """Size of the object in bytes."""
        return int(self._call(path, lambda full: self._backend.fs.size(full)))

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names of the immediate children of `prefix`; empty when it does not exist."""

        def names(full: str) -> list[str]:
            try:
                entries = self._backend.fs.ls(full, detail=False)
            except FileNotFoundError as exc:
                if is_missing_object(exc):
                    return []
                raise
            base = full.rstrip("/")
            return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry != base]

        return sorted(name for name in self._call(prefix, names) if not _is_hidden(name))

    # `list` below names the method above: the builtin is spelled `builtins.list` in this class.
    def walk_files(self, prefix: str = "") -> builtins.list[str]:
        """Sorted paths (relative to this store's root) of every object below `prefix`."""
        found = self._call(prefix, lambda full: self._backend.fs.find(full))
        paths = (self._backend.relative(entry) for entry in found)
        return sorted(path for path in paths if not _is_hidden(path))

    def delete(self, path: str) -> None:
        """Delete an object or everything below a prefix; deleting what is missing is fine."""
        clean_path(path, allow_empty=False)

        def remove(full: str) -> None:
            try:
                self._backend.fs.rm(full, recursive=True)
            except FileNotFoundError as exc:
                if not is_missing_object(exc):
                    raise

        self._call(path, remove)

    def upload_file(self, local_path: str | os.PathLike[str], path: str) -> None:
        """Copy a local file to `path`, atomically to readers like `write_bytes`."""
        clean_path(path, allow_empty=False)
        source = os.fspath(local_path)
        if not os.path.exists(source):
            # Checked here so that a missing source is not mistaken for a missing bucket.
            raise FileNotFoundError(errno.ENOENT, "no such local file to upload", source)
        if self._backend.is_local:
            self._call(
                path,
                lambda full: _replace_atomically(full, lambda tmp: shutil.copyfile(source, tmp)),
                writing=True,
            )
        else:
            self._call(path, lambda full: self._backend.fs.put_file(source, full), writing=True)

    def download_file(
        self,
        path: str,
        local_path: str | os.PathLike[str],
        *,
        observer: Callable[[], ChunkObserver] | None = None,
    ) -> ChunkObserver | None:
        """Copy the object to a local file; the file appears complete or not at all.

        With `observer` (a factory, e.g. a hasher class), every chunk is fed to a fresh
        observer's `update` before the file appears, and that observer is returned. On local
        disk that happens as it is copied (read, observe, write: one pass, where hashing the
        finished file would read it all again); from an object store the object comes in one
        streaming GET and the local copy is then read once for the observer. Without, the copy
        is the backend's own (an in-kernel copy on local disk) and None is returned.
        """
        target = os.path.abspath(os.fspath(local_path))
        fs = self._backend.fs

        def copy(full: str) -> ChunkObserver | None:
            if observer is None:
                _replace_atomically(target, lambda tmp: fs.get_file(full, tmp))
                return None
            watching = observer()
            if self._backend.is_local:
                with open(full, "rb", buffering=0) as local:
                    _replace_atomically(
                        target, lambda tmp: _copy_observed(local, tmp, watching, _LOCAL_CHUNK)
                    )
            else:
                # One streaming GET, then a pass over the local copy: measured on moto S3, one
                # ranged GET per chunk to hash on the way costs more than re-reading the file.
                def fetch(tmp: str) -> None:
                    fs.get_file(full, tmp)
                    _observe_file(tmp, watching, _REMOTE_CHUNK)

                _replace_atomically(target, fetch)
            return watching

        return self._call(path, copy)
