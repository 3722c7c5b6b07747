"""``--pp N``: pipeline parallelism with ``torch.distributed.pipelining``.

An ``nn.Sequential`` is cut into N stages of consecutive children (as even as
the children allow), one per rank; each rank keeps only its stage, under the
children's original names (so checkpoints of the stages fit together). A
training step runs ``--microbatches`` microbatches through torch's
``ScheduleGPipe`` or ``Schedule1F1B`` (``--schedule``), which also scale the
gradients by 1/microbatches, so a mean-reduced loss gives the gradients of the
whole batch.
"""

from __future__ import annotations

import torch


class _Stage(torch.nn.Module):
    """Some consecutive children of an ``nn.Sequential``, under their original names."""

    def __init__(self, named_children) -> None:
        super().__init__()
        for name, child in named_children:
            self.add_module(name, child)

    def forward(self, x):
        for child in self._modules.values():
            x = child(x)
        return x


def split(children: list, stages: int) -> list[list]:
    """``children`` cut into ``stages`` consecutive runs whose lengths differ by at most one."""
    size, extra = divmod(len(children), stages)
    runs, start = [], 0
    for stage in range(stages):
        end = start + size + (1 if stage < extra else 0)
        runs.append(children[start:end])
        start = end
    return runs


class PipelinedModel(torch.nn.Module):
    """This rank's pipeline stage; train with :meth:`train_step`, not by calling it."""

    def __init__(self, model, options, mesh, device) -> None:
        from torch.distributed.pipelining import PipelineStage

        super().__init__()
        if not isinstance(model, torch.nn.Sequential):
            raise ValueError(f"--pp cuts an nn.Sequential into stages; got {type(model).__name__} (wrap its layers "
                             "in nn.Sequential)")
        children = list(model.named_children())
        if len(children) < options.pp:
            raise ValueError(f"--pp {options.pp} needs at least {options.pp} children in the nn.Sequential "
                             f"(it has {len(children)})")
        self.stage_index = mesh.get_local_rank()
        self.num_stages = options.pp
        self.stage = _Stage(split(children, options.pp)[self.stage_index]).to(device)
        self.microbatches = options.microbatches
        self.schedule_name = options.schedule
        self._group = mesh.get_group()
        self._last_rank = torch.distributed.get_global_rank(self._group, self.num_stages - 1)
        self._pipe = PipelineStage(self.stage, self.stage_index, self.num_stages, device, group=self._group)
        self._schedule = None
        self._loss_fn = None
        self._device = device

    @property
    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model (--pp) trains with model.train_step(inputs, target=..., loss_fn=...) "
                           "on every rank; it cannot be called like a module")

    def train_step(self, *inputs, target=None, loss_fn=None):
        """Forward and backward of one batch through every stage, in microbatches.

        Call it on every rank with the same arguments: the first stage uses
        ``inputs``, the last ``target`` and ``loss_fn(output, target)``. Returns
        the batch's mean loss on every rank. The gradients are then in this
        stage's parameters: call ``optimizer.step()``.
        """
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        from workbench.metrics.logger import LOGGER

        if loss_fn is None:
            raise TypeError("train_step needs loss_fn=, e.g. torch.nn.functional.mse_loss")
        if self._schedule is None or loss_fn is not self._loss_fn:
            schedule = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            self._schedule = schedule(self._pipe, n_microbatches=self.microbatches, loss_fn=loss_fn)
            self._loss_fn = loss_fn
        losses: list = []
        if self.is_first_stage:
            LOGGER.samples_seen(int(inputs[0].shape[0]))
            self._schedule.step(*inputs)
        elif self.is_last_stage:
            self._schedule.step(target=target, losses=losses)
        else:
            self._schedule.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self._device)
        torch.distributed.broadcast(loss, src=self._last_rank, group=self._group)
        return loss
