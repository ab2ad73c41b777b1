"""Relative object paths: `/`-separated, validated, joined the same way on every backend.

A path that escapes its root (`..`), is absolute, or has empty segments would mean different
things on a local disk and in a bucket, so such paths are refused before any IO happens.
"""

from __future__ import annotations

_FORBIDDEN_SEGMENTS = frozenset({".", ".."})


def clean_path(path: str, *, allow_empty: bool = True) -> str:
    """Return `path` unchanged if it is a safe relative path, else raise `ValueError`."""
    if not isinstance(path, str):
        raise TypeError(f"object path must be a str, got {type(path).__name__}")
    if path == "":
        if allow_empty:
            return path
        raise ValueError("object path must not be empty here")
    if path.startswith("/"):
        raise ValueError(f"object path {path!r} must be relative, not start with '/'")
    if "\\" in path or "\x00" in path:
        raise ValueError(f"object path {path!r} must not contain a backslash or NUL")
    for segment in path.split("/"):
        if segment == "":
            raise ValueError(f"object path {path!r} has an empty segment ('//' or a trailing '/')")
        if segment in _FORBIDDEN_SEGMENTS:
            raise ValueError(f"object path {path!r} must not contain '.' or '..' segments")
    return path


def join(*parts: str) -> str:
    """Join relative paths, skipping empty parts; the result is validated."""
    return clean_path("/".join(part for part in parts if part))
