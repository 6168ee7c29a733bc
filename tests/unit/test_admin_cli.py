"""`pdserve admin`: what its exit code tells a script."""

import grpc
import pytest

from pdserve.v1 import admin_pb2
from services.controller.admin_cli import _print_planner, exit_code
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


def test_admin_planner_shows_each_decisions_forecast_predictions_and_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = admin_pb2.PlannerStatus(
        enabled=True, targets=admin_pb2.PlannerTargets(ttft_p90_s=1.0, itl_p90_s=0.05)
    )
    status.decisions.add(at_unix_s=0, action="hold", current="1P1D", target="1P1D",
                         reason="nothing to forecast: no request served yet")  # fmt: skip
    status.decisions.add(
        at_unix_s=2, action="change", current="1P1D", target="1P2D",
        reason="1P1D misses the targets, 1P2D meets them", predicted_ttft_p90_s=0.024,
        predicted_itl_p90_s=0.0097, observed_ttft_p90_s=0.038, observed_itl_p90_s=0.0249,
        forecast_rate_per_s=10.0, forecast_requests=40, forecast_prompt_tokens=900.4,
        forecast_cached_tokens=512, forecast_output_tokens=1,
    )  # fmt: skip
    _print_planner(status)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "targets: TTFT p90 1 s, ITL p90 0.05 s"
    assert "forecast rate prompt(cached)->output" in lines[1]
    hold, change = lines[2].split(), lines[3].split()
    assert hold[1:5] == ["hold", "1P1D", "1P1D", "-"] and hold[5:7] == ["-/-", "-/-"]
    assert change[1:5] == ["change", "1P1D", "1P2D", "10.0/s"]
    assert change[5:8] == ["900(512)->1", "24/10", "38/25"]
    assert lines[3].endswith("1P1D misses the targets, 1P2D meets them")
