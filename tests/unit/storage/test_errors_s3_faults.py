"""S3 fault chains seen against real servers, classified the way they heal."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, ReadTimeoutError

from storage.errors import TransientStorageError
from storage.retry import RetryPolicy

URI = "s3://bucket/run/checkpoints/step_000001/model.safetensors"


def _aborted_multipart_upload() -> FileNotFoundError:
    """What s3fs raised against a loaded moto server: a part upload timed out, the abort then
    found no such upload, and s3fs turned that answer into FileNotFoundError."""
    answer = {"Error": {"Code": "NoSuchUpload", "Message": "The specified upload does not exist."}}
    client_error = ClientError(answer, "AbortMultipartUpload")
    client_error.__context__ = ReadTimeoutError(endpoint_url="http://127.0.0.1:9/b/k?uploadId=u")
    error = FileNotFoundError("The specified upload does not exist.")
    error.__cause__ = client_error
    return error


def test_a_vanished_multipart_upload_is_retried_not_reported_as_a_missing_bucket() -> None:
    calls = []

    def upload() -> None:
        calls.append(1)
        raise _aborted_multipart_upload()

    with pytest.raises(TransientStorageError, match="NoSuchUpload") as error:
        RetryPolicy(retries=2, backoff_s=0).call(URI, upload, writing=True)
    assert len(calls) == 3
    assert str(error.value).startswith(f"{URI}: gave up after 3 attempts")


def test_a_vanished_multipart_upload_succeeds_on_the_next_attempt() -> None:
    calls = []

    def upload() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise _aborted_multipart_upload()
        return "done"

    assert RetryPolicy(retries=2, backoff_s=0).call(URI, upload, writing=True) == "done"
