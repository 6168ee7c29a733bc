"""A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`): a head and worker
nodes, each a raylet with its own resources and worker processes, so that placement spreads
instances over nodes and a node can be lost whole (its raylet and every worker on it killed)."""

import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray._private.utils import get_ray_address_file
from ray.cluster_utils import Cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RayNodes:
    cluster: Cluster
    workers: list[Any]  # ray._private.node.Node of each worker node, in start order

    @property
    def address(self) -> str:
        address: str = self.cluster.address
        return address

    def node_of(self, node_id: str) -> Any:
        """The worker node whose Ray node id is `node_id`."""
        [node] = [n for n in self.workers if n.node_id == node_id]
        return node

    def add(self, num_cpus: int, tries: int = 3) -> Any:
        """A fresh worker node of `num_cpus` CPUs. Ray gives a new raylet 30 s to register
        with the GCS, which a loaded small machine can miss (a 30-minute soak did once, after
        seven node losses): another try then, up to `tries` in all. A raylet that missed its
        start is reaped with this process."""
        for attempt in range(1, tries):
            try:
                node = self.cluster.add_node(num_cpus=num_cpus)
                break
            except Exception as error:  # Ray raises a bare Exception for the timeout
                if "timed out during startup" not in str(error):
                    raise
                print(f"a new Ray node did not start (try {attempt}): {error}", flush=True)
        else:
            node = self.cluster.add_node(num_cpus=num_cpus)
        self.workers.append(node)
        return node

    def kill(self, node: Any) -> None:
        """Lose `node` whole: SIGKILL its raylet and every process it started, no goodbye to
        the GCS (which notices by the missed heartbeats)."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)


@contextmanager
def ray_nodes(head_cpus: int, worker_cpus: list[int]) -> Iterator[RayNodes]:
    """A head of `head_cpus` CPUs and one worker node per entry of `worker_cpus`, on the
    machine's address (`ray.init` resolves a loopback address to it); Ray's token
    authentication as the environment sets it (the tests' conftest turns it on)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-mn-", dir="/tmp"))  # short: socket paths
    # `Cluster` records the head's address in Ray's default temp dir, whatever `temp_dir` says,
    # and fails on a machine where no Ray has run yet (that directory is missing).
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "gcs_server_port": _free_port(),
            "temp_dir": str(temp_dir),
            "include_dashboard": False,
        },
    )
    try:
        workers = [cluster.add_node(num_cpus=cpus) for cpus in worker_cpus]
        cluster.wait_for_nodes()
        yield RayNodes(cluster, workers)
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
