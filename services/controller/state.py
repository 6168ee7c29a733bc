"""Where `pdserve up` keeps its state (cluster.json and the 0600 secret files beside it), and
the instance plane's TLS files. No Ray import: `up` needs the path before Ray is imported."""

from pathlib import Path

import platformdirs

from pdserve.config import ClusterConfig
from pdserve.rpc.tls import TlsFiles


def state_path(config: ClusterConfig) -> Path:
    base = (
        Path(config.state_dir) if config.state_dir else Path(platformdirs.user_state_dir("pdserve"))
    )
    return base / "cluster.json"


def tls_files(config: ClusterConfig) -> TlsFiles | None:
    """The instance plane's mutual TLS files (`cluster.tls_*`), or None when it is plaintext."""
    if not (config.tls_cert and config.tls_key and config.tls_ca):
        return None
    return TlsFiles(config.tls_cert, config.tls_key, config.tls_ca, config.tls_server_name)
