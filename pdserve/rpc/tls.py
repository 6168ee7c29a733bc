"""Mutual TLS for the instance plane (`cluster.tls_cert`, `tls_key`, `tls_ca`).

Every instance serves with its certificate and requires a client certificate signed by the
cluster's CA; every client (router, peers, admin, `pdserve generate --cluster`) presents the
same kind of certificate and verifies the server's against the CA. Certificates name the
instances by one DNS name (`tls_server_name`, default `pdserve-instance`) that clients expect
whatever address they dial, so one certificate can serve every node. The cluster secret is
still checked on top (`pdserve.rpc.auth`).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.errors import ConfigError

DEFAULT_SERVER_NAME = "pdserve-instance"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: this process's certificate and key, and the CA that signs every peer's."""

    cert: str
    key: str
    ca: str
    server_name: str = DEFAULT_SERVER_NAME

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return (
                Path(self.cert).read_bytes(),
                Path(self.key).read_bytes(),
                Path(self.ca).read_bytes(),
            )
        except OSError as e:
            raise ConfigError(f"cannot read a TLS file of cluster.tls_*: {e}") from e

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A channel to `address` that presents this certificate and checks the peer's."""
        credentials, options = self.channel_credentials(options)
        return grpc.secure_channel(address, credentials, options=options)

    def channel_credentials(
        self, options: list[tuple[str, Any]]
    ) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
        """(credentials, `options` plus the server-name override) of a mutual-TLS channel,
        sync or `grpc.aio`."""
        cert, key, ca = self._read()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        return credentials, [*options, ("grpc.ssl_target_name_override", self.server_name)]
