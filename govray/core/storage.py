"""Where an experiment's files live: a local directory, or object storage (``s3://BUCKET/PREFIX``).

govray reads and writes files on a local path in both cases. For object storage that path is this
node's cache of the storage (the ``cache`` setting, ``GOVRAY_CACHE``, default ``~/.cache/govray``:
``govray.core.settings``; then a directory per
storage URI — the same path on every node of a cluster whose nodes share a user and environment):
what a process writes there it ``upload``s, and what it needs it ``fetch``es first. Downloads land
in a staging directory that the caller's ``verify`` (the shard or checkpoint manifest's digests)
must accept before it becomes visible in the cache, and uploads send a directory's manifest last,
so a reader never sees a manifest without its files.

Credentials come from the environment only, as for any AWS client (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, or the node's instance
role); ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` points at an S3-compatible server.

Example::

    storage = open_storage("s3://my-bucket/govray")
    spec = storage.root / "runs" / "run-1.json"   # ~/.cache/govray/<hash>/runs/run-1.json
    spec.write_text("{}")
    storage.upload(spec)                          # s3://my-bucket/govray/runs/run-1.json
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from govray.core.errors import GovrayError

if TYPE_CHECKING:  # pyarrow loads only where object storage is used: a local store's readers skip it
    import pyarrow.fs as pafs

SEALS = ("manifest.json", "manifest.sig")  # uploaded last: they make a directory complete
T = TypeVar("T")


class StorageError(GovrayError):
    """Object storage is unreachable, refuses the credentials, or lacks what a run needs."""


class Storage:
    """An experiment's storage: ``root`` is the local directory govray works in. One interface
    with two twins, chosen once by :func:`open_storage`: ``LocalStorage`` (the files are ``root``
    itself: nothing to fetch or upload) and ``ObjectStorage`` (``root`` is this node's cache of a
    bucket). Code that holds a ``Storage`` never asks which it has: it fetches before it reads and
    uploads after it writes, and the local twin does nothing."""

    is_remote = False  # the files live in object storage (``ObjectStorage``)
    filesystem: pafs.FileSystem | None = None  # Ray Train's and Tune's ``storage_filesystem``

    def __init__(self, uri: str, root: Path) -> None:
        self.uri = uri
        self.root = root

    def ray_path(self, path: Path) -> str:
        """How Ray Train and Tune are told a directory below ``root`` (``filesystem`` being their
        ``storage_filesystem``): its object key for object storage, else the path itself."""
        return str(path)

    def local_path(self, reported: str) -> Path:
        """Where a path Ray reported lies on this node."""
        return Path(reported)

    def cached(self, reported: str) -> Path:
        """The cache path of a directory Ray reported (an object key, or a local path), fetched
        when this node lacks it."""
        path = self.local_path(reported)
        self.fetch(path)
        return path

    def uri_of(self, path: Path) -> str:
        """``s3://BUCKET/PREFIX/...`` of a path below ``root`` (the path itself when local)."""
        return str(path)

    def check(self) -> None:
        """Refuse, with the bucket and endpoint named, storage that cannot be read and written."""

    def upload(self, *paths: Path) -> None:
        """Copy files, or directories' files (each one's manifests last), from the cache to the
        storage."""

    def fetch(self, path: Path, verify: Callable[[Path], object] | None = None) -> bool:
        """Make ``path`` (a file or directory) present on this node, downloading it when missing
        below ``root``; ``verify(staged)`` must accept a download before it appears at ``path``.
        Returns whether ``path`` exists now (False: in neither place)."""
        return Path(path).exists()

    def list_files(self, directory: Path) -> list[str]:
        """The names of the files right below ``directory`` in the storage (none when local)."""
        return []

    def pull_growing(self, path: Path, destination: Path | None = None) -> bool:
        """Copy the stored copy of a file that only grows (a log) to ``destination`` (default:
        ``path`` in the cache) when it is longer there than here; returns whether it copied."""
        return False

    def delete_file(self, path: Path) -> None:
        """Remove a file below ``root`` from the cache and from the storage (either one already
        gone is fine)."""
        Path(path).unlink(missing_ok=True)

    def delete_directory(self, path: Path) -> None:
        """Remove a directory below ``root`` from the cache and from the storage (either one
        already gone is fine; a file in its place is an ``OSError``, and nothing remote is touched)."""
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)

    def subdirectories(self, directory: Path, prefix: str) -> list[str]:
        """The names of the subdirectories of ``directory`` whose names start with ``prefix``, in
        this node's cache and, for object storage, in the storage; sorted by name."""
        directory = Path(directory)
        if not directory.is_dir():
            return []
        return sorted(
            path.name for path in directory.iterdir() if path.is_dir() and path.name.startswith(prefix)
        )

    def fetch_latest(
        self, directory: Path, prefix: str, verify: Callable[[Path], object] | None = None
    ) -> None:
        """Fetch the last (by name) subdirectory of ``directory`` whose name starts with ``prefix``
        (checkpoints are named so that this is the newest)."""


class LocalStorage(Storage):
    """A local directory (or a shared file system every node mounts at the same path)."""


IN_PLACE = LocalStorage("(files where they lie)", Path("/"))  # no storage: read and write in place


class ObjectStorage(Storage):
    """``s3://BUCKET/PREFIX``: ``filesystem`` and ``remote`` (``BUCKET/PREFIX``) say where its files
    are kept, ``root`` is this node's cache of them."""

    is_remote = True

    def __init__(self, uri: str, root: Path, filesystem: pafs.FileSystem, remote: str) -> None:
        super().__init__(uri, root)
        self.filesystem = filesystem
        self.remote = remote
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"

    def remote_path(self, path: Path) -> str:
        """The object key (``BUCKET/PREFIX/...``) of a path below ``root``."""
        relative = Path(path).relative_to(self.root).as_posix()
        return f"{self.remote}/{relative}" if relative != "." else self.remote

    def stored(self, path: Path) -> bool:
        """``path`` lies below ``root``: the storage keeps it (a path elsewhere is this node's own)."""
        return Path(path).is_relative_to(self.root)

    def local_path(self, reported: str) -> Path:
        """The cache path of an object key below ``remote`` (Ray Train reports its checkpoints so)."""
        key = reported.removeprefix("s3://").rstrip("/")
        if not (key == self.remote or key.startswith(self.remote + "/")):
            return Path(reported)
        return self.root / key[len(self.remote) :].lstrip("/")

    def ray_path(self, path: Path) -> str:
        return self.remote_path(path)

    def uri_of(self, path: Path) -> str:
        return f"s3://{self.remote_path(path)}"

    def check(self) -> None:
        probe = f"{self.remote}/.govray-probe"
        self._call(f"write {probe}", lambda fs: _write(fs, probe, b"govray"))
        self._call(f"delete {probe}", lambda fs: fs.delete_file(probe))

    def upload(self, *paths: Path) -> None:
        for path in (Path(p) for p in paths if self.stored(Path(p))):
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            files.sort(key=lambda p: p.name in SEALS)  # stable: manifest.json before manifest.sig stays
            for file in files:
                key = self.remote_path(file)
                self._call(f"upload {file} to s3://{key}", partial(_put, file, key))

    def fetch(self, path: Path, verify: Callable[[Path], object] | None = None) -> bool:
        path = Path(path)
        if path.exists() or not self.stored(path):
            return path.exists()
        import pyarrow.fs as pafs

        key = self.remote_path(path)
        info = self._call(f"look up s3://{key}", lambda fs: fs.get_file_info(key))
        if info.type == pafs.FileType.NotFound:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        staged = staging / path.name
        if info.type == pafs.FileType.Directory:
            staged.mkdir()
        try:
            self._call(
                f"download s3://{key}",
                lambda fs: pafs.copy_files(
                    key, str(staged), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem()
                ),
            )
            if verify is not None:
                verify(staged)
            if not path.exists():  # another process on this node may have fetched it meanwhile
                staged.rename(path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return True

    def list_files(self, directory: Path) -> list[str]:
        import pyarrow.fs as pafs

        key = self.remote_path(directory)
        selector = pafs.FileSelector(key, allow_not_found=True)
        found = self._call(f"list s3://{key}", lambda fs: fs.get_file_info(selector))
        return sorted(Path(info.path).name for info in found if info.type == pafs.FileType.File)

    def pull_growing(self, path: Path, destination: Path | None = None) -> bool:
        import pyarrow.fs as pafs

        target = Path(destination or path)
        key = self.remote_path(Path(path))
        info = self._call(f"look up s3://{key}", lambda fs: fs.get_file_info(key))
        if info.type != pafs.FileType.File or (target.exists() and target.stat().st_size >= info.size):
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent)) / target.name
        try:
            self._call(
                f"download s3://{key}",
                lambda fs: pafs.copy_files(
                    key, str(staged), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem()
                ),
            )
            os.replace(staged, target)
        finally:
            shutil.rmtree(staged.parent, ignore_errors=True)
        return True

    def delete_file(self, path: Path) -> None:
        super().delete_file(path)
        if not self.stored(path):
            return
        import pyarrow.fs as pafs

        key = self.remote_path(Path(path))
        info = self._call(f"look up s3://{key}", lambda fs: fs.get_file_info(key))
        if info.type == pafs.FileType.File:
            self._call(f"delete s3://{key}", lambda fs: fs.delete_file(key))

    def delete_directory(self, path: Path) -> None:
        super().delete_directory(path)
        if not self.stored(path):
            return
        import pyarrow.fs as pafs

        key = self.remote_path(Path(path))
        info = self._call(f"look up s3://{key}", lambda fs: fs.get_file_info(key))
        if info.type != pafs.FileType.NotFound:
            self._call(f"delete s3://{key}", lambda fs: fs.delete_dir(key))

    def subdirectories(self, directory: Path, prefix: str) -> list[str]:
        names = set(super().subdirectories(directory, prefix))
        if self.stored(directory):
            import pyarrow.fs as pafs

            key = self.remote_path(Path(directory))
            selector = pafs.FileSelector(key, allow_not_found=True)
            found = self._call(f"list s3://{key}", lambda fs: fs.get_file_info(selector))
            names |= {
                Path(info.path).name
                for info in found
                if info.type == pafs.FileType.Directory and Path(info.path).name.startswith(prefix)
            }
        return sorted(names)

    def fetch_latest(
        self, directory: Path, prefix: str, verify: Callable[[Path], object] | None = None
    ) -> None:
        if names := self.subdirectories(directory, prefix):
            self.fetch(Path(directory) / names[-1], verify)

    def _call(self, what: str, action: Callable[[pafs.FileSystem], T]) -> T:
        try:
            return action(self.filesystem)
        except OSError as error:
            bucket = self.remote.split("/")[0]
            raise StorageError(
                f"object storage {self.uri} (bucket '{bucket}' at endpoint {self.endpoint}): cannot "
                f"{what}: {error}. Credentials come from the environment (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION; AWS_ENDPOINT_URL_S3 for a non-AWS server)."
            ) from error


def open_storage(storage_path: str | Path) -> Storage:
    """The storage of an experiment's ``storage_path``: a local directory, or ``s3://BUCKET/PREFIX``
    with this node's cache of it. Other schemes are refused."""
    uri = str(storage_path)
    if not uri:
        raise StorageError("no storage_path: a run's storage is a local path or s3://BUCKET[/PREFIX]")
    if "://" not in uri:
        return LocalStorage(uri, Path(uri))
    scheme, _, remote = uri.partition("://")
    remote = remote.strip("/")
    if scheme != "s3" or not remote:
        raise StorageError(f"storage_path {uri!r}: only a local path or s3://BUCKET[/PREFIX] is supported")
    from govray.core.settings import load_settings  # the settings only where a bucket is used

    root = load_settings().cache_root / hashlib.sha256(uri.encode()).hexdigest()[:16]
    return ObjectStorage(uri, root, _s3_filesystem(), remote)


def _s3_filesystem() -> pafs.S3FileSystem:
    """An S3 filesystem configured from the environment alone (never from a config file)."""
    return _s3_filesystem_for(
        os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "",
        os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "",
        os.environ.get("AWS_ACCESS_KEY_ID") or "",
        os.environ.get("AWS_SECRET_ACCESS_KEY") or "",
        os.environ.get("AWS_SESSION_TOKEN") or "",
    )


@cache
def _s3_filesystem_for(endpoint: str, region: str, key: str, secret: str, token: str) -> pafs.S3FileSystem:
    import pyarrow.fs as pafs

    options: dict[str, object] = {
        "allow_bucket_creation": False,
        "allow_bucket_deletion": False,
        "connect_timeout": 10.0,  # a wrong endpoint fails in seconds, not minutes of retries
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
    }
    if key and secret:  # else the SDK's chain: profile, then the node's instance role
        options.update(access_key=key, secret_key=secret, session_token=token or None)
    if region:
        options["region"] = region
    if endpoint:
        scheme, _, host = endpoint.rpartition("://")
        options.update(endpoint_override=host.rstrip("/"), scheme=scheme or "https")
    return pafs.S3FileSystem(**options)


def _write(filesystem: pafs.FileSystem, key: str, data: bytes) -> None:
    with filesystem.open_output_stream(key) as stream:
        stream.write(data)


def _put(file: Path, key: str, filesystem: pafs.FileSystem) -> None:
    import pyarrow.fs as pafs

    local = pafs.LocalFileSystem()
    pafs.copy_files(str(file), key, source_filesystem=local, destination_filesystem=filesystem)


def shared_staging(parent: Path, prefix: str) -> Path:
    """A new staging folder below ``parent`` (a folder of the storage) that Ray workers write
    into: created as the storage's other folders are — the umask decides, not ``mkdtemp``'s 0700
    — since the workers may run as another OS user than the driver (a deployment that keeps the
    platform's signer, the operator and the trials apart)."""
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    staging.chmod(0o777 & ~_umask())
    return staging


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, racing threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def as_created(path: Path) -> Path:
    """Give ``path`` the mode the umask gives any file this process creates: safetensors writes
    its files 0600, and the platform's signer, running as another OS user than the workers (a
    deployment's), must read every file of a checkpoint it seals."""
    Path(path).chmod(0o666 & ~_umask())
    return Path(path)
