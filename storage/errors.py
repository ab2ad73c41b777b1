"""Storage errors, and the line between faults worth retrying and faults that never heal.

Every error names the object URI it is about, so that a user reading one line of output knows
which object to look at.
"""

from __future__ import annotations

import errno


class StorageError(Exception):
    """A storage operation failed; `uri` names the object or prefix concerned."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__(f"{uri}: {reason}")
        self.uri = uri
        self.reason = reason


class PermanentStorageError(StorageError):
    """Retrying cannot help: bad credentials, a missing bucket, no permission, a full disk."""


class TransientStorageError(StorageError):
    """The store kept failing after every retry (timeouts, throttling, connection resets)."""


class CorruptObjectError(StorageError):
    """A committed object is missing, truncated or altered (size or checksum differs)."""


class NotCommittedError(StorageError):
    """The step exists but has no `_COMMITTED` marker: it is being written, or its writer died."""


class StepTimeoutError(StorageError):
    """No committed step arrived before the deadline."""


# Error codes S3-compatible servers send for faults that retrying cannot fix.
_PERMANENT_S3_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "InvalidBucketName",
        "NoSuchBucket",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "AccountProblem",
        "InvalidRequest",
        "403",
    }
)
_PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT})


def s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code carried by a botocore `ClientError`, however deeply it is wrapped."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
        current = current.__cause__ or current.__context__
    return None


def is_permanent(exc: BaseException) -> bool:
    """True when `exc` will fail the same way on every retry."""
    if isinstance(exc, PermanentStorageError | CorruptObjectError | NotCommittedError):
        return True
    if isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return True
    if isinstance(exc, PermissionError):
        return True
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return True
    code = s3_error_code(exc)
    return code in _PERMANENT_S3_CODES


def describe(exc: BaseException) -> str:
    """A one-line reason for `exc`, with the S3 error code where there is one."""
    code = s3_error_code(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if code and code not in text:
        return f"{code}: {text}"
    return text
