"""KVEventIndex: which instance holds which published KV blocks, kept from the instances' KV events.

The router asks it, per request, how many leading blocks of the request's hash chain each candidate
instance holds in its device prefix cache. Hashes come from `BlockHasher`, the same function the
instances use, so equal hashes mean equal token prefixes.

Data structure (chosen for the routing hot path): every instance gets a small integer *slot*; the
index maps a block hash to a bitmask of the slots holding it (`dict[BlockHash, int]`). `overlaps`
walks the request's chain once, AND-ing each block's mask into the set of instances still matching,
and stops as soon as that set is empty. A lookup is one dict probe and one integer AND per block,
whatever the number of instances. A per-instance set of hashes makes `replace_instance` and
`drop_instance` proportional to that instance's blocks, not to the whole index.

Locking: one `threading.Lock` guards every field. `apply`, `replace_instance` and `drop_instance`
(called from the KV-event stream threads) and `overlaps` (called from request handlers) each hold
it for their whole body, so a routing decision sees every event either entirely or not at all.
No method does I/O or calls out while holding it.
"""

import threading
from collections.abc import Iterable, Sequence

from pdserve.errors import IntegrityError
from pdserve.kvcache.events import (
    DIGEST_MODULUS,
    BlockRemoved,
    BlockStored,
    KVDigest,
    KVEvent,
    digest_term,
)
from pdserve.kvcache.hashing import BlockHash


class KVEventIndex:
    """Per-instance sets of published block hashes, answering exact prefix-overlap queries.

    An instance becomes known on its first event; queries about unknown instances answer 0.
    Applying a `BlockStored` for a hash the instance already holds, or a `BlockRemoved` for one it
    does not hold, changes nothing (events after a stream reset may repeat or miss history).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[BlockHash, int] = {}  # hash -> bitmask of slots holding it
        self._blocks: dict[str, set[BlockHash]] = {}  # instance id -> hashes it holds
        self._slots: dict[str, int] = {}  # instance id -> slot (bit position)
        self._sums: dict[str, int] = {}  # instance id -> its digest's hash sum
        self._free_slots: list[int] = []  # slots of dropped instances, reused lowest first

    def apply(self, instance_id: str, event: KVEvent) -> None:
        """Record that `instance_id` stored or removed the event's blocks.

        Mutates the index under the lock; registers the instance on its first event.
        """
        with self._lock:
            slot = self._slot_of(instance_id)
            if isinstance(event, BlockStored):
                self._store(instance_id, slot, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(instance_id, slot, event.block_hashes)

    def replace_instance(self, instance_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Make `block_hashes` the whole view of `instance_id` (a KV-event snapshot), in one
        step under the lock: no query sees a half-replaced view."""
        with self._lock:
            slot = self._slot_of(instance_id)
            self._clear(instance_id, slot)
            self._store(instance_id, slot, block_hashes)

    def drop_instance(self, instance_id: str) -> None:
        """Forget `instance_id` and all its blocks (it died or left); its slot is reused.
        Unknown ids are ignored. Takes the lock."""
        with self._lock:
            slot = self._slots.pop(instance_id, None)
            if slot is None:
                return
            self._clear(instance_id, slot)
            del self._blocks[instance_id]
            del self._sums[instance_id]
            self._free_slots.append(slot)
            self._free_slots.sort(reverse=True)

    def overlaps(
        self, block_hashes: Sequence[BlockHash], instances: Iterable[str]
    ) -> dict[str, int]:
        """For each of `instances`, how many leading blocks of `block_hashes` it holds.

        Exact prefix overlap: counting stops at the first block the instance lacks, even if it
        holds later ones. Unknown instances get 0. Reads under the lock; mutates nothing.
        """
        result = dict.fromkeys(instances, 0)
        with self._lock:
            instance_of_bit = {
                1 << slot: instance_id
                for instance_id in result
                if (slot := self._slots.get(instance_id)) is not None
            }
            if not instance_of_bit:
                return result
            ended = self._walk(block_hashes, sum(instance_of_bit))  # distinct bits: sum == OR
        for mask, depth in ended:
            while mask:
                bit = mask & -mask
                result[instance_of_bit[bit]] = depth
                mask ^= bit
        return result

    def digest(self, instance_id: str) -> KVDigest:
        """The digest of the blocks `instance_id` holds here (empty if unknown); the instance
        reports its own to compare. Takes the lock."""
        with self._lock:
            blocks = self._blocks.get(instance_id, ())
            return KVDigest(len(blocks), self._sums.get(instance_id, 0))

    def num_blocks(self, instance_id: str) -> int:
        """How many blocks `instance_id` holds (0 if unknown). Takes the lock."""
        with self._lock:
            return len(self._blocks.get(instance_id, ()))

    def instances(self) -> tuple[str, ...]:
        """The known instance ids, sorted. Takes the lock."""
        with self._lock:
            return tuple(sorted(self._slots))

    def __len__(self) -> int:
        """Number of distinct block hashes held by at least one instance."""
        with self._lock:
            return len(self._holders)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the hash -> slots map and the per-instance sets agree."""
        with self._lock:
            owners = {slot: instance_id for instance_id, slot in self._slots.items()}
            if len(owners) != len(self._slots) or set(owners) & set(self._free_slots):
                raise IntegrityError(f"slots are shared: {self._slots}, free {self._free_slots}")
            if set(self._blocks) != set(self._slots):
                raise IntegrityError("instances with blocks differ from instances with slots")
            for block_hash, mask in self._holders.items():
                self._check_holders(block_hash, mask, owners)
            for instance_id, blocks in self._blocks.items():
                if KVDigest.of(blocks) != KVDigest(len(blocks), self._sums[instance_id]):
                    raise IntegrityError(f"{instance_id}: its digest's hash sum is off")
            num_held = sum(mask.bit_count() for mask in self._holders.values())
            num_listed = sum(len(blocks) for blocks in self._blocks.values())
            if num_held != num_listed:
                raise IntegrityError(
                    f"{num_held} (hash, instance) pairs indexed, {num_listed} listed"
                )

    # -- internals: callers hold the lock ------------------------------------------------------

    def _walk(self, block_hashes: Sequence[BlockHash], wanted: int) -> list[tuple[int, int]]:
        """(slots that stopped matching, at which depth) pairs; every wanted slot is in one."""
        holders = self._holders
        alive = wanted
        ended: list[tuple[int, int]] = []
        for depth, block_hash in enumerate(block_hashes):
            held = holders.get(block_hash, 0) & alive
            if held != alive:
                ended.append((alive ^ held, depth))
                alive = held
                if not alive:
                    return ended
        ended.append((alive, len(block_hashes)))
        return ended

    def _slot_of(self, instance_id: str) -> int:
        slot = self._slots.get(instance_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[instance_id] = slot
            self._blocks[instance_id] = set()
            self._sums[instance_id] = 0
        return slot

    def _store(self, instance_id: str, slot: int, block_hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks[instance_id]
        holders = self._holders
        bit = 1 << slot
        added = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                blocks.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit
                added += digest_term(block_hash)
        self._sums[instance_id] = (self._sums[instance_id] + added) % DIGEST_MODULUS

    def _remove(self, instance_id: str, slot: int, block_hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks[instance_id]
        removed = 0
        for block_hash in block_hashes:
            if block_hash in blocks:
                blocks.remove(block_hash)
                self._unset(block_hash, slot)
                removed += digest_term(block_hash)
        self._sums[instance_id] = (self._sums[instance_id] - removed) % DIGEST_MODULUS

    def _clear(self, instance_id: str, slot: int) -> None:
        for block_hash in self._blocks[instance_id]:
            self._unset(block_hash, slot)
        self._blocks[instance_id] = set()
        self._sums[instance_id] = 0

    def _unset(self, block_hash: BlockHash, slot: int) -> None:
        mask = self._holders[block_hash] & ~(1 << slot)
        if mask:
            self._holders[block_hash] = mask
        else:
            del self._holders[block_hash]

    def _check_holders(self, block_hash: BlockHash, mask: int, owners: dict[int, str]) -> None:
        if not mask:
            raise IntegrityError(f"block {block_hash.hex()[:16]} is indexed with no holder")
        for slot in range(mask.bit_length()):
            if not mask >> slot & 1:
                continue
            owner = owners.get(slot)
            if owner is None or block_hash not in self._blocks[owner]:
                raise IntegrityError(f"block {block_hash.hex()[:16]} claims slot {slot} wrongly")
