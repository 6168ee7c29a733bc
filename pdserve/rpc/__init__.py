"""gRPC plumbing: server and channel factories, proto <-> dataclass conversion."""
