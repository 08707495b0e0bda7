"""Local folders and fsspec URLs for ``bucket_path`` and saved trainer configs.

Why fsspec: it is already installed with ``huggingface_hub`` and speaks ``file://``,
``gs://`` (gcsfs), ``s3://`` (s3fs) and more. A protocol whose filesystem package is
missing is a :class:`ConfigError` that names the package, at construction time rather
than an hour into a job.
"""

from __future__ import annotations

import os

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.folders import write_atomic

_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs"}


def protocol_of(path: str) -> str | None:
    """``"gs"`` for ``gs://b/x``; None for a plain local path."""
    return path.split("://", 1)[0].lower() if "://" in path else None


def local_path(path: str) -> str | None:
    """The local path of ``path`` (plain or ``file://``), None for a remote URL."""
    proto = protocol_of(path)
    if proto is None:
        return os.path.abspath(os.path.expanduser(path))
    if proto in ("file", "local"):
        return os.path.abspath(path.split("://", 1)[1])
    return None


def check_storage(path: str, field: str) -> None:
    """Raise ConfigError if ``path``'s protocol cannot be read here."""
    proto = protocol_of(path)
    if proto is None or proto in ("file", "local"):
        return
    import fsspec

    try:
        fsspec.get_filesystem_class(proto)
    except ImportError:
        package = _PACKAGES.get(proto, f"the fsspec implementation for {proto}://")
        raise ConfigError(f"{field}={path!r}: reading {proto}:// needs {package}; install it "
                          f"(pip install {package}) or use a local folder") from None
    except ValueError:
        raise ConfigError(f"{field}={path!r}: unknown storage protocol {proto!r}") from None


def fetch(path: str, cache_dir: str) -> str:
    """A local folder holding ``path``'s files (remote folders are copied into ``cache_dir``)."""
    local = local_path(path)
    if local is not None:
        if not os.path.exists(local):
            raise CheckpointError(f"bucket_path {path!r} does not exist")
        return local
    check_storage(path, "bucket_path")
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(root):
        raise CheckpointError(f"bucket_path {path!r} does not exist")
    target = os.path.join(cache_dir, root.strip("/").replace("/", "_"))
    if not os.path.isdir(target):
        fs.get(root.rstrip("/") + "/", target + ".partial", recursive=True)
        os.replace(target + ".partial", target)
    return target


def read_text(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    local = local_path(path)
    if local is not None:
        with open(local) as f:
            return f.read()
    check_storage(path, "path")
    import fsspec

    with fsspec.open(path, "r") as f:
        return f.read()


def write_text(path: str | os.PathLike, text: str) -> None:
    path = os.fspath(path)
    local = local_path(path)
    if local is not None:
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        write_atomic(local, text)
        return
    check_storage(path, "path")
    import fsspec

    with fsspec.open(path, "w") as f:
        f.write(text)
