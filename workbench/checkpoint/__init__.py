"""Checkpoints: sharded (torch.distributed.checkpoint), async, atomic, listable, reshardable.

Inside ``%%distributed`` cells: ``workbench.checkpoint.save(...)``,
``restore(...)``, ``maybe_save(every=N)``, ``register(name, obj)``, ``wait()``.
From the kernel: ``%checkpoint save|list|restore|rm`` (:mod:`workbench.kernel.checkpoints`).
On disk: :mod:`.layout`.
"""

from workbench.checkpoint.api import maybe_save, register, restore, save, wait

__all__ = ["maybe_save", "register", "restore", "save", "wait"]
