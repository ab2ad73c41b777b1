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

    def __reduce__(self) -> tuple[type[StorageError], tuple[object, ...]]:
        # Prefect and multiprocessing pickle exceptions; the default rebuilds from the message only.
        return type(self), (self.uri, self.reason)


class PermanentStorageError(StorageError):
    """Retrying cannot help: bad credentials, a missing bucket, no permission, a full disk."""


class TransientStorageError(StorageError):
    """The store kept failing after every retry (timeouts, throttling, connection resets)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist.

    It is also a `FileNotFoundError`, so code written against plain files (`except
    FileNotFoundError`) keeps working, while the message still names the full URI.
    """


class CorruptObjectError(StorageError):
    """A committed object is missing, truncated or altered (size or checksum differs)."""


class NotCommittedError(StorageError):
    """The step exists but has no `_COMMITTED` marker: it is being written, or its writer died."""


class StepTimeoutError(StorageError):
    """No committed step arrived before the deadline."""


class AlreadyCommittedError(StorageError, FileExistsError):
    """The step is committed already; committed steps are immutable, so readers can trust them."""


class InvalidRolloutError(StorageError, ValueError):
    """Rollout rows that break the shard schema, naming the shard (if any), the row and the column.

    A `ValueError` too: on write it is the caller's data that is wrong, not the store.
    """

    def __init__(
        self, uri: str, detail: str, row: int | None = None, column: str | None = None
    ) -> None:
        where = [f"row {row}"] if row is not None else []
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(uri, ": ".join([", ".join(where), detail]) if where else detail)
        self.detail = detail
        self.row = row
        self.column = column

    def __reduce__(self) -> tuple[type[StorageError], tuple[str, str, int | None, str | None]]:
        return type(self), (self.uri, self.detail, self.row, self.column)


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
# Missing or unusable credentials in botocore and google-auth, matched by class name so that
# storage works without those packages installed.
_PERMANENT_CLASS_NAMES = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "DefaultCredentialsError",
        "RefreshError",
    }
)

# Error codes and HTTP statuses that mean "the server is busy or hiccuped": retry later.
_TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        # The server no longer knows a multipart upload. Seen against a loaded server: a part
        # timed out, the server finished or dropped the upload meanwhile, and s3fs's abort then
        # raised this as FileNotFoundError. Starting the whole PUT over is the cure.
        "NoSuchUpload",
    }
)
_TRANSIENT_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# s3fs turns unknown and 5xx server answers into these errnos; local disks use them for hiccups.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.EAGAIN,
        errno.EBUSY,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        getattr(errno, "EREMOTEIO", errno.EIO),
    }
)
# Network faults of the HTTP stacks under s3fs/gcsfs (botocore, aiohttp, urllib3), matched by
# class name so that storage works without those packages installed.
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "HTTPClientError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ProtocolError",
    }
)


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from: s3fs hides the botocore error in `__cause__`."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _has_class_named(exc: BaseException, names: frozenset[str]) -> bool:
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code carried by a botocore `ClientError`, however deeply it is wrapped."""
    for current in _chain(exc):
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a gcsfs `HttpError` (`.code`) or an aiohttp response error (`.status`)."""
    for current in _chain(exc):
        for attribute in ("status", "code"):
            value = getattr(current, attribute, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
    return None


def is_permanent(exc: BaseException) -> bool:
    """True when `exc` will fail the same way on every retry."""
    if isinstance(exc, PermanentStorageError | CorruptObjectError | NotCommittedError):
        return True
    if isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return s3_error_code(exc) not in _TRANSIENT_S3_CODES
    if isinstance(exc, PermissionError):
        return True
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return True
    if any(_has_class_named(current, _PERMANENT_CLASS_NAMES) for current in _chain(exc)):
        return True
    code = s3_error_code(exc)
    return code in _PERMANENT_S3_CODES


def is_missing_object(exc: BaseException) -> bool:
    """True when `exc` says the object is absent, as opposed to its bucket (which is permanent)
    or a multipart upload in flight (which is transient)."""
    if not isinstance(exc, FileNotFoundError):
        return False
    code = s3_error_code(exc)
    return code != "NoSuchBucket" and code not in _TRANSIENT_S3_CODES


def is_transient(exc: BaseException) -> bool:
    """True when the same call may well succeed if tried again a little later."""
    if is_permanent(exc):
        return False
    for current in _chain(exc):
        if isinstance(current, TimeoutError | ConnectionError):
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        if _has_class_named(current, _TRANSIENT_CLASS_NAMES):
            return True
    code = s3_error_code(exc)
    if code is not None and (code in _TRANSIENT_S3_CODES or code.startswith("5")):
        return True
    return _http_status(exc) in _TRANSIENT_HTTP_STATUSES


# Codes that mean the server refused who we are or what we may do. Answers to HEAD requests carry
# no body, so there the bare status ("403") is all a client gets.
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "401",
        "403",
    }
)


def describe(exc: BaseException) -> str:
    """A one-line reason for `exc`, with the S3 error code where there is one.

    Refused credentials say so in plain words: a bare "403: Forbidden" does not tell a user
    that the fix is in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the bucket policy.
    """
    code = s3_error_code(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = f"{code}: {text}" if code and code not in text else text
    if code in _REFUSED_CODES or (code is None and _http_status(exc) in (401, 403)):
        return f"access refused, check the credentials and their permissions ({reason})"
    return reason
