"""One table (`pdserve.errors.STATUSES`) from error classes to gRPC statuses and HTTP errors."""

import grpc
import pytest

from pdserve import errors
from pdserve.errors import (
    STATUSES,
    DecodeUnavailableError,
    DuplicateRequestError,
    InvalidRequestError,
    KVTransferError,
    ModelNotFoundError,
    NoCapacityError,
    OutOfBlocksError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
    RequestNotFoundError,
    ResourceExhaustedError,
    StepFailedError,
    TensorParallelError,
    class_of_code,
    http_error,
)
from pdserve.rpc.status import classify, error_from_reply, error_reply
from pdserve.v1 import common_pb2


def test_every_row_names_a_grpc_status_and_an_error_code() -> None:
    for _, status in STATUSES:
        assert status.grpc_status in grpc.StatusCode.__members__
        common_pb2.ErrorCode.Value("ERROR_CODE_" + status.error_code)


def test_no_row_is_shadowed_by_an_earlier_more_general_one() -> None:
    classes = [cls for cls, _ in STATUSES]
    for i, general in enumerate(classes):
        assert not any(issubclass(later, general) for later in classes[i + 1 :]), general


def test_every_error_class_has_a_row() -> None:
    public = [v for v in vars(errors).values() if isinstance(v, type)]
    for cls in public:
        if issubclass(cls, PdserveError):
            assert any(issubclass(cls, row) for row, _ in STATUSES), cls


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("RESOURCE_EXHAUSTED", ResourceExhaustedError),
        ("PROMPT_TOO_LONG", PromptTooLongError),
        ("STEP_FAILED", StepFailedError),
        ("INTERNAL", PdserveError),
        ("UNSPECIFIED", PdserveError),
    ],
)
def test_a_code_is_rebuilt_as_its_most_general_class(code: str, cls: type) -> None:
    assert class_of_code(code) is cls


@pytest.mark.parametrize(
    ("error", "rebuilt"),
    [
        (OutOfBlocksError("x", 3), ResourceExhaustedError),
        (NoCapacityError("x", 3), ResourceExhaustedError),
        (TensorParallelError("x"), StepFailedError),
        (DecodeUnavailableError("x", 7), DecodeUnavailableError),
    ],
)
def test_a_subclass_crosses_the_wire_as_its_codes_class(
    error: PdserveError, rebuilt: type[PdserveError]
) -> None:
    back = error_from_reply(error_reply(error))
    assert type(back) is rebuilt and str(back) == "x"


def test_grpc_statuses_come_from_the_table() -> None:
    assert classify(DuplicateRequestError("x"))[:3] == (
        common_pb2.ERROR_CODE_DUPLICATE_REQUEST,
        grpc.StatusCode.ALREADY_EXISTS,
        "x",
    )
    assert classify(KVTransferError("x", 9))[1:] == (grpc.StatusCode.FAILED_PRECONDITION, "x", 9)
    assert classify(PdserveError("x"))[:2] == (
        common_pb2.ERROR_CODE_INTERNAL,
        grpc.StatusCode.INTERNAL,
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ModelNotFoundError("m"), (404, "invalid_request_error", "model_not_found", "m", None)),
        (PromptTooLongError("m"), (400, "invalid_request_error", "context_length_exceeded", "m",
                                   None)),
        (InvalidRequestError("m"), (400, "invalid_request_error", None, "m", None)),
        (DuplicateRequestError("m"), (400, "invalid_request_error", None, "m", None)),
        (ResourceExhaustedError("m", 2500), (503, "server_overloaded", "no_capacity", "m", 2)),
        (NoCapacityError("m"), (503, "server_overloaded", "no_capacity", "m", 1)),
        (RequestAbortedError("m"), (503, "server_error", "request_aborted", "m", 1)),
        (RequestNotFoundError("m"), (503, "server_error", "upstream_error",
                                     "the request failed: m", 1)),
        (StepFailedError("m", 100), (503, "server_error", "upstream_error",
                                     "the request failed: m", 1)),
        (PdserveError("m"), (503, "server_error", "upstream_error", "the request failed: m", 1)),
        (ValueError("secret"), (500, "server_error", None, "internal server error", None)),
    ],
)  # fmt: skip
def test_http_errors_come_from_the_table(
    error: Exception, expected: tuple[int, str, str | None, str, int | None]
) -> None:
    answer = http_error(error)
    assert (answer.status, answer.type, answer.code, answer.message, answer.retry_after_s) == (
        expected
    )
