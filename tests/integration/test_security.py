"""Secure defaults over real servers: the embedded Redis is locked, the instance plane is
authenticated."""

import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from credentials import SECRET, channels
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.config import DecodeConfig, EngineConfig
from pdserve.engine.request import SamplingParams
from pdserve.instance.convert import generate_request
from pdserve.rpc.auth import authenticated_channel
from pdserve.rpc.channels import ChannelPool
from pdserve.rpc.clients import DecodeClient, InstanceClient
from pdserve.rpc.tls import TlsFiles
from pdserve.storage.redis_server import EmbeddedRedis, redacted
from pdserve.v1 import common_pb2, common_pb2_grpc, decode_pb2, decode_pb2_grpc
from services.decode.instance import DecodeInstance
from services.decode.servicer import serve_decode
from services.mixed.servicer import serve_mixed


def test_embedded_redis_refuses_a_client_without_its_password(
    redis_server: EmbeddedRedis,
) -> None:
    url = redis_server.url
    parts = url.split("@")
    assert len(parts) == 2 and len(parts[0].rsplit(":", 1)[1]) >= 32  # a generated password
    anonymous = redis.Redis(host=redis_server.host, port=redis_server.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    wrong = redis.Redis(host=redis_server.host, port=redis_server.port, password="guess")
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    assert redis.Redis.from_url(url).ping()
    config = Path(redis_server._workdir.name) / "redis.conf"
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o600
    with open(f"/proc/{redis_server.process.pid}/cmdline", "rb") as f:  # type: ignore[union-attr]
        assert redis_server._password.encode() not in f.read()  # not visible to `ps`


def test_a_redis_url_is_printed_without_its_password() -> None:
    assert redacted("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redacted("rediss://user:s3cret@h/1") == "rediss://user:***@h/1"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted("redis://h/0?password=s3cret&db=1") == "redis://h/0?password=***&db=1"
    assert redacted("redis://:s3cret@[::1]:6379/0") == "redis://:***@[::1]:6379/0"
    assert "s3cret" not in redacted("redis://:s3cret@h:99999999/0")
    sentinels = "redis+sentinel://app:s3cret@s1:26379,s2:26379/main/0?sentinel_password=t0p"
    assert redacted(sentinels) == (
        "redis+sentinel://app:***@s1:26379,s2:26379/main/0?sentinel_password=***"
    )


def test_embedded_redis_refuses_commands_that_would_reach_the_host(
    redis_server: EmbeddedRedis,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    for command in (("CONFIG", "SET", "dir", "/tmp"), ("MODULE", "LIST"), ("SLAVEOF", "NO", "ONE")):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)
    assert client.ping()


# -- the instance plane ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_instance(tiny_model_dir: Path) -> Iterator[tuple[DecodeInstance, str]]:
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)
    instance, server, port = serve_decode(engine, DecodeConfig(), secret=SECRET)
    yield instance, f"127.0.0.1:{port}"
    server.stop(0)
    instance.check_integrity()
    instance.stop()


ROUTER = "router-1"  # the real router's output subscription


def reserve_message(request_id: str) -> decode_pb2.ReserveRequest:
    params = SamplingParams(max_tokens=4)
    request = generate_request(request_id, [5] * 40, params, subscriber=ROUTER)
    return decode_pb2.ReserveRequest(request=request)


def calls(channel: grpc.Channel) -> dict[str, Callable[[], object]]:
    """Every guarded kind of call an attacker would make, on `channel`."""
    decode = decode_pb2_grpc.DecodeServiceStub(channel)
    instance = common_pb2_grpc.InstanceServiceStub(channel)
    chunk = decode_pb2.KVChunk(
        request_id="victim", first_block=0, num_blocks=1, data=b"x", last=True
    )
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    listing = reflection_pb2.ServerReflectionRequest(list_services="")
    return {
        "ServerReflectionInfo": lambda: next(
            iter(reflection.ServerReflectionInfo(iter([listing]), timeout=10))
        ),
        "Reserve": lambda: decode.Reserve(reserve_message("intruder"), timeout=10),
        "Abort": lambda: instance.Abort(common_pb2.AbortRequest(request_id="victim"), timeout=10),
        "PushKV": lambda: decode.PushKV(iter([chunk]), timeout=10),
        "CommitKV": lambda: decode.CommitKV(
            decode_pb2.CommitKVRequest(request_id="victim", first_block=0, num_blocks=1),
            timeout=10,
        ),
        "GetStats": lambda: instance.GetStats(common_pb2.StatsRequest(), timeout=10),
        "SubscribeKVEvents": lambda: next(
            iter(instance.SubscribeKVEvents(common_pb2.KVEventsRequest(), timeout=10))
        ),
        "SubscribeOutputs": lambda: next(  # would take over the router's outputs
            iter(instance.SubscribeOutputs(common_pb2.OutputsRequest(subscriber=ROUTER)))
        ),
    }


@pytest.mark.parametrize("token", [None, "wrong-secret"], ids=["no secret", "wrong secret"])
def test_instance_rpcs_without_the_cluster_secret_are_refused_and_change_nothing(
    decode_instance: tuple[DecodeInstance, str], token: str | None
) -> None:
    instance, address = decode_instance
    own = channels()
    router = common_pb2_grpc.InstanceServiceStub(own.get(address))
    outputs = router.SubscribeOutputs(common_pb2.OutputsRequest(subscriber=ROUTER), timeout=120)
    try:
        assert not next(outputs).outputs  # the real router's subscription is open
        # a live reservation of the real client: what an intruder's Abort or PushKV would hit
        DecodeClient(address, own).reserve(reserve_message("victim"))
        before = instance.stats()
        plain = grpc.insecure_channel(address)
        channel = plain if token is None else authenticated_channel(plain, token)
        for name, call in calls(channel).items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert SECRET not in (refused.value.details() or ""), name
        plain.close()
        after = instance.stats()
        assert (after.num_reservations, after.num_reserved_blocks) == (
            before.num_reservations, before.num_reserved_blocks,
        )  # fmt: skip
        assert after.kv_blocks_received == before.kv_blocks_received
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1  # SERVING
        assert InstanceClient(address, own).abort("victim")  # the secret's holder may
    finally:
        outputs.cancel()
        own.close()


# -- mutual TLS on the instance plane ---------------------------------------------------------


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A throwaway CA: (certificate, key)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def make_node_cert(directory: Path, ca: tuple[Path, Path], name: str) -> tuple[Path, Path]:
    """A certificate for `pdserve-instance` signed by `ca`, for servers and clients alike."""
    cert, key, csr = directory / f"{name}.pem", directory / f"{name}.key", directory / "n.csr"
    extensions = directory / "ext.cnf"
    extensions.write_text(
        "subjectAltName=DNS:pdserve-instance\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    subprocess.run(
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(csr), "-subj", "/CN=pdserve-instance"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
         "-CAcreateserial", "-days", "1", "-out", str(cert), "-extfile", str(extensions)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_the_instance_plane_over_mutual_tls_admits_only_certified_clients(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    ca = make_ca(tmp_path, "cluster-ca")
    node = make_node_cert(tmp_path, ca, "node")
    tls = TlsFiles(str(node[0]), str(node[1]), str(ca[0]))
    engine = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16)
    instance, server, port = serve_mixed(engine, secret=SECRET, tls=tls)
    address = f"127.0.0.1:{port}"
    try:
        certified = ChannelPool(SECRET, tls)
        assert InstanceClient(address, certified).stats().num_blocks == 16
        certified.close()

        other_ca = make_ca(tmp_path, "other-ca")
        stranger = make_node_cert(tmp_path, other_ca, "stranger")
        strangers = {
            "plaintext": grpc.insecure_channel(address),
            "no client certificate": grpc.secure_channel(
                address,
                grpc.ssl_channel_credentials(root_certificates=ca[0].read_bytes()),
                options=[("grpc.ssl_target_name_override", "pdserve-instance")],
            ),
            "another CA's certificate": TlsFiles(
                str(stranger[0]), str(stranger[1]), str(ca[0])
            ).channel(address, []),
        }
        for name, channel in strangers.items():
            stub = common_pb2_grpc.InstanceServiceStub(authenticated_channel(channel, SECRET))
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetStats(common_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name
            channel.close()
    finally:
        server.stop(0)
        instance.check_integrity()
        instance.stop()
