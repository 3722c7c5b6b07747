"""Checkpoints: sharded (torch.distributed.checkpoint), async, atomic, listable, reshardable.

Inside ``%%distributed`` cells: ``workbench.checkpoint.save(...)``,
``restore(...)``, ``maybe_save(every=N)``, ``register(name, obj)``, ``wait()``.
From the kernel: ``%checkpoint save|list|restore|rm`` (:mod:`.control`).
On disk: :mod:`.layout`.
"""

from .api import maybe_save, register, restore, save, wait

__all__ = ["maybe_save", "register", "restore", "save", "wait"]
