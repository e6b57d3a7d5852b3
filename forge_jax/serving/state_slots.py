"""The serving engine's recurrent-state slots: for a model whose layers keep a state per
sequence (Qwen3-Next's gated delta-rule layers), which slot of its state pool each running
request's sequence lives in.

The pool says how many sequences it holds (``max_sequences``, from ``create_pool``'s
``max_seqs``); the engine admits a waiting request only while fewer run (:meth:`room`), and
each step's batch names the slot of each of its sequences (:meth:`assign`, read by
:func:`forge_jax.serving.batch_step.build_batch` into the step's ``state_slots``). A request
keeps its slot while it runs; the slot returns when the request leaves the block manager
(finished, cancelled or preempted). A slot is not cleared when it changes hands: a sequence
whose first new token is at position 0 starts from zero states whatever its slot holds
(:class:`~forge_jax.kv_cache.RaggedStatePool`), which also restarts a preempted request
recomputed from its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from forge_jax.kv_cache import BlockManager


class StateSlots:
    """The slots of one engine's state pool (``capacity`` None: the pool keeps no state per
    sequence, and nothing is assigned)."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self._slots: dict[int, int] = {}  # request id -> slot

    @classmethod
    def of(cls, pool) -> StateSlots:
        """The slots of an engine's ``pool`` (the model's ``create_pool``): its
        ``max_sequences`` when it keeps a state per sequence."""
        return cls(getattr(pool, "max_sequences", None))

    def room(self, running: int) -> bool:
        """Whether one more request may run beside ``running`` ones."""
        return self.capacity is None or running < self.capacity

    def assign(self, scheduled: Sequence, manager: BlockManager) -> list[int] | None:
        """The slot of each ``(request, rows)`` of a step (None without a capacity): slots of
        requests no longer in ``manager`` go back first, then each request without one takes
        the lowest free."""
        if self.capacity is None:
            return None
        for request_id in [i for i in self._slots if i not in manager]:
            del self._slots[request_id]
        free = sorted(set(range(self.capacity)) - set(self._slots.values()), reverse=True)
        out = []
        for r, _ in scheduled:
            if r.id not in self._slots:
                if not free:
                    raise RuntimeError(f"no recurrent-state slot free for request {r.id}: "
                                       f"{len(self._slots)} of {self.capacity} in use")
                self._slots[r.id] = free.pop()
            out.append(self._slots[r.id])
        return out

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._slots)
