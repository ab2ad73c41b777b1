"""Turning a root URI into an fsspec filesystem, with the settings each backend needs.

The settings that matter for primeflow are decided here once: S3 uses path-style addressing
(MinIO, SeaweedFS and moto need it), filesystem instances are never shared between stores (two
stores with different endpoints must not talk to the same server), listings are never cached
(pools poll for commits made by other processes), and the backends' own retry loops are turned
off so that `storage.retry` is the only one and its limits mean what they say.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage.paths import clean_path

# Keys that would carry credentials inside storage options; credentials come from the
# environment (or the standard AWS / Google chains) so that they are never held by a store.
_CREDENTIAL_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
)
_PROTOCOL_ALIASES = {"gcs": "gs"}
_SUPPORTED = ("file", "memory", "s3", "gs")


@dataclass(frozen=True)
class Backend:
    """A filesystem and the root path inside it, in the form that filesystem expects."""

    fs: fsspec.AbstractFileSystem
    protocol: str
    root: str

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    def full_path(self, path: str) -> str:
        """The filesystem path of `path`, relative to the root."""
        if not path:
            return self.root
        return f"{self.root.rstrip('/')}/{path}"

    def relative(self, full_path: str) -> str:
        """Inverse of `full_path` for paths the filesystem returns from listings."""
        prefix = self.root.rstrip("/") + "/"
        if not full_path.startswith(prefix):
            raise ValueError(f"{full_path!r} is not below the store root {self.root!r}")
        return full_path[len(prefix) :]

    def url(self, path: str) -> str:
        """The full URI of `path`."""
        full = self.full_path(path)
        if self.protocol == "file":
            return f"file://{full}"
        return f"{self.protocol}://{full.lstrip('/')}"


def split_uri(root_uri: str) -> tuple[str, str]:
    """(protocol, location) of a root URI; bare paths are local files."""
    if "://" not in root_uri:
        return "file", root_uri
    scheme, _, location = root_uri.partition("://")
    protocol = _PROTOCOL_ALIASES.get(scheme.lower(), scheme.lower())
    if protocol not in _SUPPORTED:
        raise ValueError(f"unsupported storage URI {root_uri!r}: use one of {_SUPPORTED}")
    return protocol, location


def _local_root(location: str) -> str:
    """Absolute local path; relative ones (`file://./runs`, `runs`) resolve against the cwd."""
    if not location:
        raise ValueError("a local storage URI needs a path, e.g. file://./runs")
    return os.path.abspath(os.path.expanduser(location))


def _bucket_root(protocol: str, location: str) -> str:
    bucket, _, prefix = location.strip("/").partition("/")
    if not bucket:
        raise ValueError(f"{protocol}:// URI needs a bucket, e.g. {protocol}://bucket/prefix")
    clean_path(prefix)
    return f"{bucket}/{prefix}" if prefix else bucket


def _check_no_credentials(protocol: str, options: dict[str, Any]) -> None:
    nested = options.get("client_kwargs") or {}
    found = sorted((_CREDENTIAL_OPTIONS & options.keys()) | (_CREDENTIAL_OPTIONS & nested.keys()))
    if protocol == "gs" and "token" in found and isinstance(options.get("token"), str):
        # gcsfs takes `token` as a method name ("anon", "google_default") or a key-file path.
        found.remove("token")
    if found:
        raise ValueError(
            f"storage options must not carry credentials ({', '.join(found)}); "
            "set them in the environment (AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS, ...)"
        )


def _s3_filesystem(
    endpoint_url: str | None, region: str | None, options: dict[str, Any]
) -> fsspec.AbstractFileSystem:
    import s3fs

    config_kwargs: dict[str, Any] = {
        "s3": {"addressing_style": "path"},
        "retries": {"total_max_attempts": 1},
    }
    if region:
        # botocore's Config carries the region without touching the process environment; it is
        # not put in client_kwargs, where s3fs would also send it as a bucket LocationConstraint.
        config_kwargs["region_name"] = region
    config_kwargs.update(options.pop("config_kwargs", {}))
    kwargs: dict[str, Any] = {
        "skip_instance_cache": True,
        "use_listings_cache": False,
        "config_kwargs": config_kwargs,
    }
    endpoint = (
        endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    retries = options.pop("retries", 1)
    kwargs.update(options)
    fs = s3fs.S3FileSystem(**kwargs)
    # s3fs reads its retry count from this attribute; it is not a constructor argument.
    fs.retries = retries
    return fs


def _gcs_filesystem(endpoint_url: str | None, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    import gcsfs

    kwargs: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    kwargs.update(options)
    return gcsfs.GCSFileSystem(**kwargs)


def open_backend(
    root_uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Backend:
    """The filesystem and root path for `root_uri` (file://, bare path, memory://, s3://, gs://)."""
    protocol, location = split_uri(root_uri)
    options = dict(storage_options or {})
    _check_no_credentials(protocol, options)
    if protocol in ("file", "memory") and (endpoint_url or region):
        raise ValueError(f"endpoint_url and region apply to s3:// and gs://, not {root_uri!r}")
    if region and protocol != "s3":
        raise ValueError(f"region applies to s3:// only, not {root_uri!r}")
    if protocol == "file":
        return Backend(LocalFileSystem(**options), "file", _local_root(location))
    if protocol == "memory":
        root = location.strip("/")
        clean_path(root)
        return Backend(fsspec.filesystem("memory", **options), "memory", f"/{root}")
    root = _bucket_root(protocol, location)
    if protocol == "s3":
        return Backend(_s3_filesystem(endpoint_url, region, options), "s3", root)
    return Backend(_gcs_filesystem(endpoint_url, options), "gs", root)
