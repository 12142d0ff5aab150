"""The point store: one Parquet file per finished point, so a sweep resumes where it stopped.

Layout: ``<root>/<study name>/<key>.parquet``, where ``key`` hashes the study's identity (its
name and fixed defaults), the point's parameters, the project version and the contents of the
files the point names (``Study.files``, e.g. a trace). Each file holds the point's rows exactly
as ``paged.sweeps.point.execute`` made them (plain scalars; list/dict values and columns of mixed
types as JSON text, decoded on read), so a row read back equals the row written.

Invariants: a file appears whole or not at all (written to a temporary name, then renamed);
only the driver writes (workers return rows), so a store needs no shared file system; a key is
never written twice by one sweep. The project version is the package's: after changing code
that alters results, re-run with ``force=True`` (or pass ``version=``) -- the store cannot tell.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from paged.errors import ConfigError

from .grid import point_id
from .registry import Study

SUFFIX = ".parquet"
_JSON_COLUMNS = b"paged.json_columns"
_PARAMS = b"paged.params"


def project_version() -> str:
    """The installed version of the workbench (part of every point's key)."""
    try:
        return metadata.version("paged-kv-workbench")
    except metadata.PackageNotFoundError:
        return "unknown"


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (a missing file hashes as its name: the study will say it is missing)."""
    p = Path(path)
    if not p.is_file():
        return f"missing:{p}"
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("the point store writes Parquet and needs pyarrow: pip install pyarrow "
                          "(or pass store=False to keep results in memory only)") from None
    return pa, pq


def normalize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with every column of the point (missing -> None), in first-seen order: the
    shape a row has after a round trip through the store."""
    cols = dict.fromkeys(c for r in rows for c in r)
    return [{c: r.get(c) for c in cols} for r in rows]


class PointStore:
    """The stored points of one study under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, study: Study, version: str | None = None) -> None:
        _pyarrow()  # before any point runs: a store that cannot write says so first
        self.study = study
        self.version = project_version() if version is None else str(version)
        self.folder = Path(root) / study.name
        self._digests: dict[str, str] = {}

    def key(self, params: Mapping[str, Any]) -> str:
        """The point's key: 24 hex digits of sha256 over study, parameters, version and named files."""
        files = {}
        for name in self.study.files:
            v = params.get(name)
            if isinstance(v, (str, os.PathLike)) and v:
                path = os.fspath(v)
                if path not in self._digests:
                    self._digests[path] = file_digest(path)
                files[name] = self._digests[path]
        text = json.dumps({"study": self.study.identity, "params": point_id(params), "version": self.version,
                           "files": files}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def keys(self) -> set[str]:
        """Keys of the points stored so far."""
        if not self.folder.is_dir():
            return set()
        return {p.name[: -len(SUFFIX)] for p in self.folder.iterdir() if p.name.endswith(SUFFIX)}

    def save(self, key: str, rows: list[dict[str, Any]], params: Mapping[str, Any]) -> None:
        """Write a point's rows (atomically: a reader sees the whole file or none)."""
        pa, pq = _pyarrow()
        rows = normalize(rows)
        columns: dict[str, list[Any]] = {c: [r[c] for r in rows] for c in rows[0]} if rows else {}
        as_json, arrays = [], {}
        for c, vals in columns.items():
            kinds = {type(v) for v in vals if v is not None}
            if len(kinds) > 1 or kinds & {list, dict}:
                as_json.append(c)
                vals = [json.dumps(v) for v in vals]
            arrays[c] = pa.array(vals)
        meta = {_JSON_COLUMNS: json.dumps(as_json).encode(), _PARAMS: point_id(params).encode()}
        table = pa.table(arrays).replace_schema_metadata(meta)
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, final)

    def load(self, key: str) -> list[dict[str, Any]] | None:
        """A stored point's rows (``cached=True``), or None if it is not stored."""
        path = self.path(key)
        return read_rows(path) if path.is_file() else None


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of one point file, JSON columns decoded, marked ``cached=True``."""
    _, pq = _pyarrow()
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    as_json = json.loads(meta.get(_JSON_COLUMNS, b"[]"))
    rows = table.to_pylist()
    for r in rows:
        for c in as_json:
            r[c] = json.loads(r[c])
        if "cached" in r:
            r["cached"] = True
    return rows


__all__ = ["PointStore", "project_version", "file_digest", "normalize", "read_rows", "SUFFIX"]
