"""Where `pdserve up` keeps its state (cluster.json and the 0600 secret files beside it).
No Ray import: `up` needs the path before Ray is imported."""

from pathlib import Path

import platformdirs

from pdserve.config import ClusterConfig


def state_path(config: ClusterConfig) -> Path:
    base = (
        Path(config.state_dir) if config.state_dir else Path(platformdirs.user_state_dir("pdserve"))
    )
    return base / "cluster.json"
