"""InstanceActor: one prefill or decode instance inside a Ray actor process.

A plain class: the controller applies `ray.remote(...)` with the resources from config, so the
same class runs in a unit test without Ray. Ray carries only lifecycle calls; KV bytes and tokens
go over the instance's own gRPC server.
"""

import logging
import os

import grpc
import torch

from pdserve.config import ClusterConfig
from pdserve.rpc.server import advertised_host, host_port
from services.controller.state import tls_files
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode
from services.mixed.instance import MixedInstance
from services.mixed.servicer import serve_mixed
from services.prefill.instance import PrefillInstance
from services.prefill.servicer import serve_prefill

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")


class InstanceActor:
    """Ray calls its methods one at a time (a synchronous actor); the instance it holds runs its own
    threads.
    """

    def __init__(self, role: str, config: ClusterConfig, secret: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        engine = config.engine_for(role)
        tls = tls_files(config)
        if engine.torch_threads is not None:
            torch.set_num_threads(engine.torch_threads)
        self.role = role
        self.instance: PrefillInstance | DecodeInstance | MixedInstance
        self.server: grpc.Server
        if role == "prefill":
            self.instance, self.server, port = serve_prefill(
                engine,
                config.prefill,
                config.host,
                storage=config.storage,
                transfer=config.transfer,
                secret=secret,
                tls=tls,
            )
        elif role == "decode":
            self.instance, self.server, port = serve_decode(
                engine,
                config.decode,
                config.host,
                storage=config.storage,
                transfer=config.transfer,
                secret=secret,
                tls=tls,
            )
        else:
            self.instance, self.server, port = serve_mixed(
                engine, config.host, storage=config.storage, secret=secret, tls=tls
            )
        self._address = host_port(advertised_host(config.host), port)

    def address(self) -> str:
        """host:port of this instance's gRPC server."""
        return self._address

    def metrics_address(self) -> str:
        """host:port of this instance's Prometheus endpoint (`/metrics`)."""
        return self.instance.runtime.metrics_address

    def pid(self) -> int:
        """The actor's process id (operators kill or inspect it; tests do)."""
        return os.getpid()

    def ping(self) -> bool:
        return True

    def flush_cache(self, tier: str) -> int:
        """Unpublish every unreferenced block of the device prefix cache (`device`), or drop
        every entry of the storage tier's index (`storage`; shared by all instances). Returns
        how many blocks or entries went."""
        runtime = self.instance.runtime
        return runtime.flush_device_cache() if tier == "device" else runtime.flush_storage()

    def check_integrity(self) -> None:
        self.instance.check_integrity()

    def stop(self) -> None:
        self.server.stop(grace=2).wait()
        self.instance.stop()
