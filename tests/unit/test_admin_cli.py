"""`pdserve admin`: what its exit code tells a script."""

import grpc
import pytest

from services.controller.admin_cli import exit_code
from services.controller.cli import main


def test_admin_cli_exit_codes_tell_retry_later_from_caller_mistakes() -> None:
    assert exit_code(grpc.StatusCode.UNAVAILABLE) == 3
    assert exit_code(grpc.StatusCode.DEADLINE_EXCEEDED) == 3
    assert exit_code(grpc.StatusCode.NOT_FOUND) == 3  # no such instance (now)
    assert exit_code(grpc.StatusCode.FAILED_PRECONDITION) == 3  # not in a state to do it
    assert exit_code(grpc.StatusCode.UNAUTHENTICATED) == 2
    assert exit_code(grpc.StatusCode.INVALID_ARGUMENT) == 2


def test_admin_cli_names_an_argument_that_is_not_a_number_before_calling() -> None:
    # an address where nothing listens: the refusal comes before any call is made
    common = ["--address", "127.0.0.1:1", "--token", "t"]
    with pytest.raises(SystemExit, match=r"scale: not a number: 'two' \(usage: .* ROLE REPLICAS"):
        main(["admin", "scale", "decode", "two", *common])
    with pytest.raises(SystemExit, match=r"planner: not a number: '1s'"):
        main(["admin", "planner", "1s", "0.05", *common])
