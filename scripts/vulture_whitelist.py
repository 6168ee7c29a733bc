"""Names vulture (min confidence 80) reports that are used, each with the reason.

Run by `make lint`: vulture pdserve services scripts/vulture_whitelist.py --min-confidence 80.
"""

# services/decode/servicer.py: _HandlerRecorder.add_registered_method_handlers must take grpc's
# `service` argument (it stands in for a grpc.Server), though it only keeps the handlers.
service  # noqa: B018

# services/router/load.py: Lease.__exit__ has the context-manager protocol's signature.
exc_type  # noqa: B018
traceback  # noqa: B018
