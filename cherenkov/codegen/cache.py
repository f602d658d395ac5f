"""On-disk cache of compiled kernels, safe for several processes at once.

An entry is keyed by the sha256 of (source, arch, compiler version, flags) and holds
``<key>.cubin``, ``<key>.ptx`` and ``<key>.json`` (kernel name, resource report, compile
time and the sha256 of the two binaries). Every file is written to a temporary file in
the same folder and moved into place with ``os.replace``; the JSON goes last, so a reader
that finds it finds complete binaries. On load the binaries' hashes are checked: a
tampered or torn entry is a miss (and is rewritten by the next compile).
The folder is ``$CHERENKOV_CACHE_DIR`` if set, else ``user_cache_dir("cherenkov")/kernels``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from cherenkov.codegen.plan import ResourceReport

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "CHERENKOV_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$CHERENKOV_CACHE_DIR``, else the user cache folder's ``kernels/``."""
    override = os.environ.get(CACHE_DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_cache_dir("cherenkov")) / "kernels"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_key(source: str, arch: str, compiler_version: str, flags: tuple[str, ...]) -> str:
    """sha256 over everything that determines the binary."""
    material = "\0".join([source, arch, compiler_version, *flags])
    return sha256_hex(material.encode())


@dataclass(frozen=True)
class CacheEntry:
    """A verified cache entry: paths of its binaries and what was recorded with them."""

    cubin_path: Path
    ptx_path: Path
    kernel_name: str
    report: ResourceReport
    compile_seconds: float


class KernelCache:
    """Content-addressed store of cubin + PTX + metadata under one folder."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def _paths(self, key: str) -> tuple[Path, Path, Path]:
        return self.root / f"{key}.cubin", self.root / f"{key}.ptx", self.root / f"{key}.json"

    def load(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` if present and intact, else None."""
        cubin_path, ptx_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            intact = (
                sha256_hex(cubin_path.read_bytes()) == meta["cubin_sha256"]
                and sha256_hex(ptx_path.read_bytes()) == meta["ptx_sha256"]
            )
            if not intact:
                log.warning("kernel cache entry %s failed its hash check; recompiling", key[:16])
                return None
            return CacheEntry(
                cubin_path, ptx_path, meta["kernel_name"], ResourceReport(**meta["report"]), meta["compile_seconds"]
            )
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as err:
            log.warning("kernel cache entry %s is unreadable (%s); recompiling", key[:16], err)
            return None

    def store(
        self, key: str, cubin: bytes, ptx: str, kernel_name: str, report: ResourceReport, compile_seconds: float
    ) -> CacheEntry:
        """Write an entry atomically (binaries first, metadata last) and return it."""
        self.root.mkdir(parents=True, exist_ok=True)
        cubin_path, ptx_path, meta_path = self._paths(key)
        ptx_bytes = ptx.encode()
        meta = {
            "kernel_name": kernel_name,
            "report": asdict(report),
            "compile_seconds": compile_seconds,
            "cubin_sha256": sha256_hex(cubin),
            "ptx_sha256": sha256_hex(ptx_bytes),
        }
        self._write_atomic(cubin_path, cubin)
        self._write_atomic(ptx_path, ptx_bytes)
        self._write_atomic(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        return CacheEntry(cubin_path, ptx_path, kernel_name, report, compile_seconds)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
