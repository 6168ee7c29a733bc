"""`pdserve admin <verb>`: the admin gRPC API as readable tables (or `--json`).

The admin address and token come from the running cluster's state (cluster.json and
admin_token next to it), or from `--address` / `--token` / `PDSERVE_ADMIN_TOKEN`.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from pdserve.config import ClusterConfig, load_cluster_config
from pdserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2

Metadata = tuple[tuple[str, str | bytes], ...]  # what every admin call carries: the bearer token
VERBS = (
    "list", "drain", "resume", "remove", "scale", "role", "planner", "policy", "cache-stats",
    "flush", "abort", "trace",
)  # fmt: skip


def add_parser(commands: Any) -> None:
    admin = commands.add_parser("admin", help="steer a running cluster (admin gRPC API)")
    admin.add_argument("verb", choices=VERBS)
    admin.add_argument(
        "args", nargs="*", help="NAME | ROLE N | NAME ROLE | [TTFT ITL] | POLICY | TIER [NAME] | ID"
    )
    add_connection_arguments(admin)
    admin.add_argument("--json", action="store_true", help="print the reply as JSON")


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that find a running cluster's admin API (read by `connect`)."""
    parser.add_argument("--config", help="the config file given to `up` (state_dir, admin)")
    parser.add_argument("--state-dir", help="where `up` wrote cluster.json")
    parser.add_argument("--address", help="admin host:port (default: from cluster.json)")
    parser.add_argument("--token", help="bearer token (default: admin_token / env)")
    parser.add_argument("--tls-ca", help="CA certificate (PEM) when the admin API serves TLS")


def connect(args: argparse.Namespace, config: ClusterConfig) -> tuple[grpc.Channel, Metadata]:
    """A channel to the admin API and the metadata every call carries: `--address`, `--token`
    (or PDSERVE_ADMIN_TOKEN) and `--tls-ca`, else the running cluster's state. The caller
    closes the channel. Raises ClusterError when the address is needed and no cluster.json
    exists; SystemExit when no token is found."""
    from services.controller.cluster import read_state
    from services.controller.state import state_path

    address, token = args.address, args.token or os.environ.get("PDSERVE_ADMIN_TOKEN")
    if address is None:
        address = read_state(config)["admin_address"]
    if token is None:
        token_file = state_path(config).parent / "admin_token"
        token = config.admin.token or _read(token_file)
    if args.tls_ca:
        credentials = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes())
        channel = grpc.secure_channel(address, credentials)
    else:
        channel = grpc.insecure_channel(address)
    return channel, (("authorization", f"Bearer {token}"),)


def run(args: argparse.Namespace) -> int:
    config = load_cluster_config(args.config, overrides={"state_dir": args.state_dir})
    channel, metadata = connect(args, config)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    try:
        reply = _call(stub, args.verb, args.args, metadata)
    except grpc.RpcError as e:
        print(f"pdserve admin: {e.code().name}: {e.details()}", file=sys.stderr)
        return exit_code(e.code())
    finally:
        channel.close()
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2))
    else:
        _print(args.verb, reply)
    return 0


def exit_code(status: grpc.StatusCode) -> int:
    """3: the cluster cannot do it now (it, or a part it needs, is unavailable; no such
    instance; not in a state to do it); 2: anything else (a wrong token, a bad argument)."""
    if status in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        return 3
    return 2


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise SystemExit(f"pdserve: no admin token: {path} does not exist (use --token)") from None


def _call(
    stub: admin_pb2_grpc.AdminServiceStub,
    verb: str,
    args: Sequence[str],
    metadata: Metadata,
) -> Message:
    def need(count: int, usage: str) -> None:
        if len(args) < count:
            raise SystemExit(f"pdserve admin {verb}: usage: pdserve admin {verb} {usage}")

    def number(text: str, kind: Callable[[str], float]) -> float:
        try:
            return kind(text)
        except ValueError:
            raise SystemExit(f"pdserve admin {verb}: not a number: {text!r} (usage: "
                             f"pdserve admin {verb} {usage[verb][1]})") from None  # fmt: skip

    calls: dict[str, Callable[[], Message]] = {
        "list": lambda: stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=metadata),
        "drain": lambda: stub.DrainInstance(admin_pb2.InstanceRef(name=args[0]), metadata=metadata),
        "resume": lambda: stub.ResumeInstance(
            admin_pb2.InstanceRef(name=args[0]), metadata=metadata
        ),
        "remove": lambda: stub.RemoveInstance(
            admin_pb2.InstanceRef(name=args[0]), metadata=metadata
        ),
        "scale": lambda: stub.ScaleRole(
            admin_pb2.ScaleRoleRequest(role=args[0], replicas=int(number(args[1], int))),
            metadata=metadata,
        ),
        "role": lambda: stub.ChangeRole(
            admin_pb2.ChangeRoleRequest(name=args[0], role=args[1]), metadata=metadata
        ),
        "planner": lambda: (
            stub.SetPlannerTargets(
                admin_pb2.PlannerTargets(
                    ttft_p90_s=number(args[0], float), itl_p90_s=number(args[1], float)
                ),
                metadata=metadata,
            )
            if args
            else stub.GetPlannerStatus(admin_pb2.PlannerStatusRequest(), metadata=metadata)
        ),
        "policy": lambda: stub.SetRoutingPolicy(
            admin_pb2.SetRoutingPolicyRequest(policy=args[0]), metadata=metadata
        ),
        "cache-stats": lambda: stub.GetCacheStats(admin_pb2.CacheStatsRequest(), metadata=metadata),
        "flush": lambda: stub.FlushCache(
            admin_pb2.FlushCacheRequest(tier=args[0], name=args[1] if len(args) > 1 else ""),
            metadata=metadata,
        ),
        "abort": lambda: stub.AbortRequest(
            common_pb2.AbortRequest(request_id=args[0]), metadata=metadata
        ),
        "trace": lambda: stub.GetRequestTrace(
            admin_pb2.RequestTraceRequest(request_id=args[0]), metadata=metadata
        ),
    }
    usage = {
        "drain": (1, "NAME"),
        "resume": (1, "NAME"),
        "remove": (1, "NAME"),
        "scale": (2, "ROLE REPLICAS"),
        "planner": (0 if not args else 2, "[TTFT_P90_S ITL_P90_S]"),
        "role": (2, "NAME prefill|decode"),
        "policy": (1, "POLICY"),
        "flush": (1, "device|storage [NAME]"),
        "abort": (1, "ID"),
        "trace": (1, "ID"),
    }
    if verb in usage:
        need(*usage[verb])
    return calls[verb]()


def _print(verb: str, reply: Message) -> None:
    if isinstance(reply, admin_pb2.ListInstancesReply):
        _table(INSTANCE_COLUMNS, [_row(i) for i in reply.instances])
        if reply.routers:
            print()
            rows = [[r.name, r.pid, r.alive, r.restarts, r.metrics_address] for r in reply.routers]
            _table(["router", "pid", "alive", "restarts", "metrics"], rows)
    elif isinstance(reply, admin_pb2.InstanceInfo):
        _table(INSTANCE_COLUMNS, [_row(reply)])
    elif isinstance(reply, admin_pb2.CacheStatsReply):
        rows = [
            [i.name, i.queries, i.device_hits, i.peer_hits, i.storage_hits, f"{i.hit_rate:.3f}"]
            for i in reply.instances
        ]
        headers = ["name", "prompt tokens", "device hits", "peer hits", "storage hits", "hit rate"]
        _table(headers, rows)
        print(f"cluster hit rate: {reply.hit_rate:.3f}")
    elif isinstance(reply, admin_pb2.SetRoutingPolicyReply):
        print(f"routing policy changed (was {reply.previous})")
    elif isinstance(reply, admin_pb2.FlushCacheReply):
        print(f"flushed {reply.blocks} blocks")
    elif isinstance(reply, admin_pb2.PlannerStatus):
        _print_planner(reply)
    elif isinstance(reply, admin_pb2.RequestTrace):
        _print_trace(reply)
    elif isinstance(reply, common_pb2.AbortReply):
        print("aborted" if reply.found else "no such request in flight")


INSTANCE_COLUMNS = [
    "name", "role", "address", "node", "alive", "drained", "restarts", "running", "free/blocks"
]  # fmt: skip


def _row(info: admin_pb2.InstanceInfo) -> list[object]:
    s = info.stats
    return [info.name, info.role, info.address, info.node[:12], info.alive, info.drained,
            info.restarts, s.num_running, f"{s.num_free_blocks}/{s.num_blocks}"]  # fmt: skip


def _table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _print_planner(status: admin_pb2.PlannerStatus) -> None:
    """The planner's last decisions, oldest first: when, what, the split before and chosen,
    the load forecast, predicted and observed p90s (ms), why."""
    if not status.enabled:
        print("the planner is off (planner.enabled: false)")
        return
    targets = status.targets
    print(f"targets: TTFT p90 {targets.ttft_p90_s:g} s, ITL p90 {targets.itl_p90_s:g} s")

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.0f}" if seconds else "-"

    def load(d: admin_pb2.PlannerDecision) -> str:
        if not d.forecast_requests:
            return "-"
        return (f"{d.forecast_rate_per_s:.1f}/s {d.forecast_prompt_tokens:.0f}"
                f"({d.forecast_cached_tokens:.0f})->{d.forecast_output_tokens:.0f}")  # fmt: skip

    rows: list[list[object]] = [
        [time.strftime("%H:%M:%S", time.localtime(d.at_unix_s)), d.action, d.current, d.target,
         load(d), f"{ms(d.predicted_ttft_p90_s)}/{ms(d.predicted_itl_p90_s)}",
         f"{ms(d.observed_ttft_p90_s)}/{ms(d.observed_itl_p90_s)}",
         d.reason + (" (targets unreachable)" if d.unreachable else "")]
        for d in status.decisions
    ]  # fmt: skip
    _table(["at", "action", "split", "target", "forecast rate prompt(cached)->output",
            "predicted ttft/itl p90 ms", "observed ttft/itl p90 ms", "reason"], rows)  # fmt: skip


def _print_trace(trace: admin_pb2.RequestTrace) -> None:
    """A request's timeline: one row per stage, in order, with what it moved or found."""
    traced = f", trace {trace.trace_id}" if trace.trace_id else ""
    print(f"request {trace.request_id}: {trace.status}, {trace.prompt_tokens} prompt + "
          f"{trace.output_tokens} output tokens in {trace.duration_s * 1000:.1f} ms, "
          f"{trace.attempts} attempts, {trace.migrations} migrations{traced}")  # fmt: skip
    rows: list[list[object]] = [
        [s.name, s.instance or "router", f"{s.start_s * 1000:.1f}", f"{s.duration_s * 1000:.1f}",
         " ".join(f"{k}={v}" for k, v in sorted(s.attributes.items()))]
        for s in sorted(trace.stages, key=lambda s: s.start_s)
    ]  # fmt: skip
    if rows:
        _table(["stage", "instance", "at ms", "ms", "details"], rows)
