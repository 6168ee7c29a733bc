"""`pdserve admin`: what its exit code tells a script."""

import grpc

from services.controller.admin_cli import exit_code


def test_admin_cli_exit_codes_tell_retry_later_from_caller_mistakes() -> None:
    assert exit_code(grpc.StatusCode.UNAVAILABLE) == 3
    assert exit_code(grpc.StatusCode.DEADLINE_EXCEEDED) == 3
    assert exit_code(grpc.StatusCode.NOT_FOUND) == 3  # no such instance (now)
    assert exit_code(grpc.StatusCode.FAILED_PRECONDITION) == 3  # not in a state to do it
    assert exit_code(grpc.StatusCode.UNAUTHENTICATED) == 2
    assert exit_code(grpc.StatusCode.INVALID_ARGUMENT) == 2
