"""PromptAdmission: the one path by which a prompt gets its KV blocks.

Device prefix match -> the blocks staged after it (pulled from a peer instance, read from the
storage tier) -> allocation (leaving growth headroom free) -> load of the staged bytes ->
publication of the loaded blocks. The scheduler's
admission of waiting requests, `preallocate_resource_in_p` and `preallocate_resource_in_d` all
call `admit`. Engine thread only (it changes the KV cache manager).
"""

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from pdserve.engine.request import Request
from pdserve.engine.staged_reads import StagedReads, Usable
from pdserve.engine.storage_connector import StorageConnector
from pdserve.kvcache.manager import NO_MATCH, KVCacheManager, PrefixMatch


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a prompt stands after admission. Hits count prompt tokens this instance did not
    compute: `device_hit_tokens` found in its device prefix cache, then `peer_hit_tokens`
    pulled from a decode instance and `storage_hit_tokens` loaded from the storage tier."""

    device_hit_tokens: int
    storage_hit_tokens: int
    block_ids: tuple[int, ...]  # the request's block table after admission
    peer_hit_tokens: int = 0

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the request's blocks at admission."""
        return self.device_hit_tokens + self.peer_hit_tokens + self.storage_hit_tokens


class PromptAdmission:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        staged: StagedReads | None = None,
        storage_connector: StorageConnector | None = None,
    ) -> None:
        """`staged`: the engine's reads ahead (None: nothing is ever staged, as in the latency
        simulator)."""
        self.kv_cache = kv_cache
        self.staged = staged
        self.storage_connector = storage_connector

    def forget(self, request_id: str) -> None:
        """Drop the request's staged bytes and pending storage read (finished, or preempted:
        its blocks may be in storage by the time it is admitted again)."""
        if self.staged is not None:
            self.staged.forget(request_id)
        if self.storage_connector is not None:
            self.storage_connector.forget(request_id)

    def check_integrity(self, live: Collection[str]) -> None:
        """Raise IntegrityError when bytes are staged or a storage read is pending for a
        request not in `live` (a leak)."""
        if self.staged is not None:
            self.staged.check_integrity(live)
        if self.storage_connector is not None:
            self.storage_connector.check_integrity(live)

    def device_hit_blocks(self, request: Request) -> int:
        """Blocks of the request's prefix in the device cache now (no side effects)."""
        return len(self._match(request).block_ids)

    def admit(
        self,
        request: Request,
        *,
        token_budget: int | None = None,
        growth_headroom_blocks: int = 0,
    ) -> Admission | None:
        """Give a request without blocks its prefix hit plus blocks for up to `token_budget`
        more tokens (None: the rest of its tokens), if `growth_headroom_blocks` stay free after.

        Sets `num_computed_tokens` to the hit, loads the staged blocks and records the hits of
        the request's first admission. Returns None, changing nothing, when the pool is
        too short.
        """
        kv = self.kv_cache
        prefix = self._match(request)
        device_blocks = len(prefix.block_ids)
        staged = self.staged
        usable = Usable()
        if staged is not None and _reuses_kv(request):
            usable = staged.usable(request, device_blocks)
        computed = prefix.num_tokens + usable.blocks * kv.block_size
        remaining = request.num_tokens - computed
        target = computed + (remaining if token_budget is None else min(remaining, token_budget))
        if not kv.can_allocate(request, target, prefix, keep_free_blocks=growth_headroom_blocks):
            return None
        kv.allocate(request, target, prefix)
        table = kv.block_table(request.request_id)
        # `load` drops every staged byte of the request, usable or not
        if staged is not None and staged.load(request, table, device_blocks):
            kv.update_cache_blocks(request, computed)
        request.num_computed_tokens = computed
        peer = usable.pulled * kv.block_size
        storage = (usable.blocks - usable.pulled) * kv.block_size
        request.record_first_admission(prefix.num_tokens, storage, peer)
        return Admission(prefix.num_tokens, storage, tuple(table), peer)

    def _match(self, request: Request) -> PrefixMatch:
        return self.kv_cache.match_prefix(request) if _reuses_kv(request) else NO_MATCH

    def num_blocks_needed(self, request: Request) -> int:
        """Free blocks `admit(request)` would take (for refusal messages)."""
        prefix = self._match(request)
        return self.kv_cache.num_blocks_to_allocate(request, request.num_tokens, prefix)

    def fits(self, request: Request, headroom_blocks: int) -> bool:
        """Whether the whole prompt's blocks fit with `headroom_blocks` left free (no change)."""
        return self.num_blocks_needed(request) + headroom_blocks <= self.kv_cache.num_free_blocks

    def growth_headroom_blocks(
        self, decoding: Iterable[Request], horizon_tokens: int | None, max_model_len: int
    ) -> int:
        """Free blocks the `decoding` requests may still need: each grows by its remaining
        `max_tokens`, at most `horizon_tokens` (None: no limit), up to `max_model_len`."""
        kv, total = self.kv_cache, 0
        for request in decoding:
            remaining = request.sampling_params.max_tokens - request.num_output_tokens
            growth = remaining if horizon_tokens is None else min(remaining, horizon_tokens)
            target = min(request.num_tokens + growth, max_model_len)
            held = len(kv.block_table(request.request_id))
            total += max(0, -(-target // kv.block_size) - held)
        return total


def _reuses_kv(request: Request) -> bool:
    """Whether cached KV may stand in for computing the prompt: not when the request wants
    every prompt position's logprobs (only a forward pass gives them)."""
    return request.sampling_params.prompt_logprobs is None
