"""The admin API over TLS: a client that trusts the certificate gets through (with its token);
a plaintext client does not."""

import subprocess
from pathlib import Path

import grpc
import pytest
from credentials import SECRET

from pdserve.config import AdminConfig, ClusterConfig
from pdserve.v1 import admin_pb2, admin_pb2_grpc
from services.controller.admin import serve_admin
from services.controller.cluster import Cluster
from services.controller.topology import Topology
from services.router.history import RequestHistory


class IdleRouter:
    """The router side of the admin API, for calls that only read it (no instances here)."""

    def __init__(self) -> None:
        self.drained: set[str] = set()
        self.history = RequestHistory()


def test_admin_api_serves_tls_when_configured(tmp_path: Path) -> None:
    cert, key = tmp_path / "admin.pem", tmp_path / "admin.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    config = AdminConfig(port=0, tls_cert=str(cert), tls_key=str(key))
    topology = Topology(Cluster(ClusterConfig(), SECRET), IdleRouter())  # type: ignore[arg-type]
    server, port = serve_admin(config, "s3cret", topology)
    auth = (("authorization", "Bearer s3cret"),)
    try:
        credentials = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            reply = stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=auth)
            assert list(reply.instances) == []
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=auth, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0).wait()
