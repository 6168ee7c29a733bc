"""A router replica's restarts: each loss is restarted after `cluster.restart_backoff_s`, however
many came before it (a replica killed now and then in a long run must not wait longer each
time), and at most `cluster.max_restarts` times within `cluster.restart_window_s`. Real replica
processes beside a real primary router; the test kills them."""

import logging
from pathlib import Path

import psutil
import pytest
from credentials import SECRET
from waiting import wait_for

from pdserve.config import EngineConfig, ObservabilityConfig, RouterConfig
from services.router.replicas import RouterReplicas
from services.router.server import serve_router

BACKOFF_S = 0.2


def test_every_loss_waits_the_first_backoff_until_the_budget_is_spent(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = EngineConfig(model=str(tiny_model_dir))
    primary = serve_router(
        RouterConfig(host="127.0.0.1", port=0, replicas=2, model_name="tiny"), engine, [], [],
        secret=SECRET,
    )  # fmt: skip
    replicas = RouterReplicas(
        primary.router, primary.port, engine, ObservabilityConfig(), SECRET, None,
        max_restarts=2, restart_window_s=600.0, restart_backoff_s=BACKOFF_S, drain_timeout_s=1.0,
    )  # fmt: skip
    caplog.set_level(logging.WARNING, logger="services.router.replicas")
    try:
        replicas.start()
        for restarts in (1, 2):
            [before] = replicas.infos()
            psutil.Process(before.pid).kill()  # the replicas' watch reaps it (our child)

            def back(pid: int = before.pid, restarts: int = restarts) -> bool:
                [now] = replicas.infos()
                return now.alive and now.pid != pid and now.restarts == restarts

            wait_for(back, 120)
        waits = [r.getMessage() for r in caplog.records if "restarting it in" in r.getMessage()]
        died = f"router replica router-1 died (exit -9); restarting it in {BACKOFF_S} s"
        assert waits == [died, died]  # not doubled: the first restart succeeded

        [last] = replicas.infos()
        psutil.Process(last.pid).kill()  # the third loss within the window: given up
        wait_for(lambda: any("budget is spent" in r.getMessage() for r in caplog.records), 30)
        [given_up] = replicas.infos()
        assert not given_up.alive and given_up.restarts == 2 and given_up.pid == last.pid
        assert caplog.records[-1].getMessage() == (
            "router replica router-1 is dead and its restart budget is spent (2 restarts tried "
            "in the last 600 s, cluster.max_restarts): the other replicas serve on"
        )
    finally:
        replicas.stop(drain_timeout_s=1.0)
        primary.stop()
