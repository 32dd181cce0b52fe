"""file:// objects: a directory on a local disk or a shared filesystem (NFS, Lustre, a mounted
bucket). Writes go to a temporary name and are renamed into place, so readers never see a part;
an exclusive write is linked into place instead (link(2) fails on a name that exists, also over
NFS). Metadata lives in a ``.meta`` JSON file next to each object. Temporary files a crash left
behind are swept by gc (`sweep_temporaries`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvtier.core.errors import ObjectNotFoundError, ObjectStoreError
from kvtier.tiers.objstore.backend import (
    ObjectBackend,
    ObjectExistsError,
    ObjectInfo,
    RequestRejectedError,
    StoreLocation,
)

_META_SUFFIX = ".meta"
_TMP_PREFIX = ".tmp-"


def _failed(what: str, exc: OSError) -> ObjectStoreError:
    if exc.errno == errno.ENAMETOOLONG:  # the name's fault, not the filesystem's
        return RequestRejectedError(f"{what}: {exc.strerror}")
    return ObjectStoreError(f"{what}: {exc.strerror}")


class LocalFsBackend(ObjectBackend):
    def __init__(self, location: StoreLocation, timeout_s: float) -> None:
        super().__init__(location, timeout_s)
        self.root = Path(location.bucket)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ObjectStoreError(f"cannot create {self.root}: {exc.strerror}") from exc

    def check_name(self, name: str) -> None:
        """The filesystem judges names (ENAMETOOLONG)."""

    def _path(self, name: str) -> Path:
        path = (self.root / name).resolve()
        if not path.is_relative_to(self.root.resolve()) or name.endswith(_META_SUFFIX):
            raise ObjectStoreError(f"object name {name!r} leaves {self.root}")
        return path

    def _write_atomic(self, path: Path, data: bytes | memoryview, exclusive: bool = False) -> None:
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if exclusive:
                os.link(tmp, path)  # FileExistsError when the name is taken
                os.unlink(tmp)
            else:
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def put(
        self,
        name: str,
        body: bytes | memoryview,
        metadata: Mapping[str, str],
        exclusive: bool = False,
    ) -> None:
        path = self._path(name)
        meta = path.with_name(path.name + _META_SUFFIX)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if exclusive:  # the body decides the race; only its winner writes the metadata
                self._write_atomic(path, body, exclusive=True)
                self._write_atomic(meta, json.dumps(dict(metadata)).encode())
            else:
                self._write_atomic(meta, json.dumps(dict(metadata)).encode())
                self._write_atomic(path, body)
        except FileExistsError as exc:
            raise ObjectExistsError(f"{path} exists") from exc
        except OSError as exc:
            raise _failed(f"writing {path}", exc) from exc

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(-1 if length is None else length)
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(name) from exc
        except OSError as exc:
            raise _failed(f"reading {path}", exc) from exc

    def head(self, name: str) -> ObjectInfo | None:
        path = self._path(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _failed(f"stat {path}", exc) from exc
        try:
            metadata = json.loads(path.with_name(path.name + _META_SUFFIX).read_bytes())
        except (OSError, ValueError):
            metadata = {}
        return ObjectInfo(name, st.st_size, st.st_mtime, metadata)

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            path = self._path(name)
            for victim in (path, path.with_name(path.name + _META_SUFFIX)):
                try:
                    victim.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise ObjectStoreError(f"deleting {victim}: {exc.strerror}") from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for dirpath, _dirs, files in os.walk(self.root):
            for fname in files:
                if fname.endswith(_META_SUFFIX) or fname.startswith(_TMP_PREFIX):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, fname), self.root)
                if not rel.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, fname))
                except FileNotFoundError:
                    continue  # deleted while listing
                yield ObjectInfo(rel, st.st_size, st.st_mtime)

    def sweep_temporaries(self, older_than: float) -> int:
        swept = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for fname in files:
                if not fname.startswith(_TMP_PREFIX):
                    continue
                path = os.path.join(dirpath, fname)
                try:
                    if os.stat(path).st_mtime < older_than:
                        os.unlink(path)
                        swept += 1
                except FileNotFoundError:
                    continue  # renamed into place or swept meanwhile
                except OSError as exc:
                    raise _failed(f"sweeping {path}", exc) from exc
        return swept

    def principal(self) -> str:
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise ObjectStoreError(f"{self.root} is not readable and writable by uid {os.getuid()}")
        return f"uid {os.getuid()}"
