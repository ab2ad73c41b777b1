"""The retry policy: what is retried, what fails at once, and what the errors say."""

from __future__ import annotations

import errno

import pytest

from storage.errors import (
    ObjectNotFoundError,
    PermanentStorageError,
    TransientStorageError,
    is_permanent,
    is_transient,
)
from storage.retry import RetryPolicy

URI = "s3://bucket/run/obj"


class Flaky:
    """Fails with `error` for the first `failures` calls, then returns "ok"."""

    def __init__(self, error: Exception, failures: int) -> None:
        self.error = error
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


class ClientError(Exception):
    """Shaped like botocore's ClientError: the code lives in `response`."""

    def __init__(self, code: str) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code, "Message": code}}


def _translated(code: str, error: OSError) -> OSError:
    """What s3fs raises: a builtin error whose cause is the ClientError."""
    error.__cause__ = ClientError(code)
    return error


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError(errno.ECONNRESET, "reset"),
        TimeoutError("read timed out"),
        _translated("SlowDown", OSError(errno.EBUSY, "Please reduce your request rate")),
        _translated("InternalError", OSError(errno.EIO, "We encountered an internal error")),
        ClientError("503"),
    ],
)
def test_transient_faults_are_retried_until_they_pass(error: Exception) -> None:
    assert is_transient(error) and not is_permanent(error)
    flaky = Flaky(error, failures=2)
    assert RetryPolicy(retries=2, backoff_s=0).call(URI, flaky) == "ok"
    assert flaky.calls == 3


def test_transient_faults_that_outlast_the_retries_name_the_uri() -> None:
    flaky = Flaky(ConnectionResetError(errno.ECONNRESET, "reset"), failures=10)
    with pytest.raises(TransientStorageError) as info:
        RetryPolicy(retries=3, backoff_s=0).call(URI, flaky)
    assert flaky.calls == 4
    assert info.value.uri == URI
    assert "gave up after 4 attempts" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionResetError)


@pytest.mark.parametrize(
    "error",
    [
        _translated("AccessDenied", PermissionError("Access Denied")),
        _translated("InvalidAccessKeyId", PermissionError("bad key")),
        _translated("NoSuchBucket", FileNotFoundError("bucket")),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EROFS, "Read-only file system"),
        type("NoCredentialsError", (Exception,), {})("Unable to locate credentials"),
    ],
)
def test_permanent_faults_fail_at_once_with_a_one_line_reason(error: Exception) -> None:
    flaky = Flaky(error, failures=10)
    with pytest.raises(PermanentStorageError) as info:
        RetryPolicy(retries=5, backoff_s=0).call(URI, flaky)
    assert flaky.calls == 1
    assert info.value.uri == URI
    assert "\n" not in str(info.value)


def test_missing_object_is_its_own_error() -> None:
    flaky = Flaky(_translated("NoSuchKey", FileNotFoundError("key")), failures=10)
    with pytest.raises(ObjectNotFoundError) as info:
        RetryPolicy().call(URI, flaky)
    assert flaky.calls == 1
    assert str(info.value) == f"{URI}: no such object"


def test_a_write_that_finds_nothing_there_lacks_its_bucket() -> None:
    flaky = Flaky(FileNotFoundError("gs://no-such-bucket/x"), failures=10)
    with pytest.raises(PermanentStorageError, match="does the bucket exist"):
        RetryPolicy().call(URI, flaky, writing=True)
    assert flaky.calls == 1


def test_bugs_are_not_storage_errors() -> None:
    flaky = Flaky(TypeError("unsupported operand"), failures=10)
    with pytest.raises(TypeError):
        RetryPolicy().call(URI, flaky)
    assert flaky.calls == 1


def test_backoff_grows_and_is_capped() -> None:
    policy = RetryPolicy(retries=50, backoff_s=0.2)
    assert 0.1 <= policy.delay_s(0) <= 0.3
    assert 0.4 <= policy.delay_s(2) <= 1.2
    assert policy.delay_s(40) <= 45.0
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)
