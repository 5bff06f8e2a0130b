"""SwapTier: the bookkeeping of a second KV tier for evicted prefix-cache blocks (torch-free).

When the block pool evicts a cached block to reuse it, the tier keeps a copy if it has room
(a swap-out: block id -> tier slot; LRU within the tier when it is full). A prefix lookup that
runs past the device pool's hits continues in the tier, and each tier hit is copied into a
fresh block (a swap-in: tier slot -> block id) instead of being recomputed. The tier only plans
the copies; the SchedulerOutput carries them and the worker's ``KVTier`` (worker/kv_tier.py)
runs them at the start of the step, every swap-out before any swap-in, both before the forward.

The tier is inclusive: a swap-in copies, the slot keeps its content, so a restored block that is
evicted again costs no second copy. Within one step every slot written or read is pinned: since
the worker runs all swap-outs first, letting a later eviction of the same step reuse such a slot
would overwrite what a swap-in has yet to read, or write one slot twice.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.kv_cache.hashing import BlockHash


class SwapTier:
    """``num_slots`` block-sized slots indexed by block hash; 0 slots: the tier is off."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._recycled: list[int] = []  # slots freed by a reset, taken before untouched ones
        self._next_unused = 0  # slots from here on were never handed out (no O(num_slots) list)
        self._pinned: set[int] = set()  # slots copied to or from in the step being planned
        self._swap_out: list[tuple[int, int]] = []  # (block id, slot), in eviction order
        self._swap_in: dict[int, int] = {}  # block id -> slot
        self.num_swapped_out = 0  # blocks, since the last take_stats()
        self.num_swapped_in = 0

    @property
    def num_used_slots(self) -> int:
        """Slots holding a block (the rest are free)."""
        return len(self._slots)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash``, or None. Read-only: a lookup commits nothing."""
        return self._slots.get(block_hash)

    def offer(self, block_hash: BlockHash, block_id: int) -> None:
        """Block ``block_id`` (cached as ``block_hash``) is being evicted: keep a copy if possible."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)  # inclusive: the tier already holds this content
            return
        slot = self._take_slot()
        if slot is None:
            return  # off, or every slot is pinned this step: the block is simply dropped
        self._slots[block_hash] = slot
        self._pinned.add(slot)
        self._swap_out.append((block_id, slot))
        self.num_swapped_out += 1

    def _take_slot(self) -> int | None:
        if self._recycled:
            return self._recycled.pop()
        if self._next_unused < self.num_slots:
            self._next_unused += 1
            return self._next_unused - 1
        for block_hash, slot in self._slots.items():  # evict the least recently used unpinned slot
            if slot not in self._pinned:
                del self._slots[block_hash]
                return slot
        return None

    def claim(self, block_hashes: list[BlockHash]) -> list[int]:
        """Pin the slots of tier hits about to be swapped in (before the allocation that follows
        may evict into the tier), most recently used; returns them in order."""
        slots = []
        for block_hash in block_hashes:
            self._slots.move_to_end(block_hash)
            slot = self._slots[block_hash]
            self._pinned.add(slot)
            slots.append(slot)
        return slots

    def swap_in(self, slot: int, block_id: int) -> None:
        """Plan the copy of claimed ``slot`` into block ``block_id`` (the last plan for a block wins)."""
        assert slot in self._pinned, f"slot {slot} was not claimed"
        self._swap_in[block_id] = slot
        self.num_swapped_in += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (swap-outs, swap-ins) as (block id, slot) pairs; unpins every slot."""
        copies = (self._swap_out, list(self._swap_in.items()))
        self._swap_out, self._swap_in = [], {}
        self._pinned.clear()
        return copies

    def take_stats(self) -> tuple[int, int]:
        """(blocks swapped out, blocks swapped in) since the last call; resets both."""
        stats = (self.num_swapped_out, self.num_swapped_in)
        self.num_swapped_out = self.num_swapped_in = 0
        return stats

    def reset(self) -> None:
        """Forget every entry (the prefix cache is being reset); planned copies stay planned."""
        self._recycled += self._slots.values()
        self._slots.clear()

    def integrity_errors(self) -> list[str]:
        """Slots used + free == capacity, and no slot is mapped twice or lies out of range."""
        used = list(self._slots.values())
        free = self._recycled + list(range(self._next_unused, self.num_slots))
        errors = []
        if len(used) + len(free) != self.num_slots:
            errors.append(f"tier slots used ({len(used)}) + free ({len(free)}) != capacity ({self.num_slots})")
        if len(set(used) | set(free)) != len(used) + len(free):
            errors.append("a tier slot is mapped twice, or both mapped and free")
        errors += [f"tier slot {s} is out of range" for s in used + free if not 0 <= s < self.num_slots]
        return errors
