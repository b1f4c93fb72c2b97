"""Where an optimizer steps: the trainable parameters of a reference model, placed where the managed model
keeps its own.

On CUDA a managed layer keeps its Parameters on the host (pinned) and their gradients land there, so a full
fine-tune's optimizer, a fused step in a post-accumulate-grad hook and an EMA run on the CPU; the unmanaged
reference keeps everything on the GPU. Optimizers are not bitwise the same on the two devices (AdamW differs
in the last bit), so a reference compared with a managed model steps host master copies of exactly those
parameters: its forward and backward stay on the GPU, each gradient is copied to its master (a copy is exact),
the optimizer steps the master and the weight is copied back. Where both live on one device (the simulator,
CPU mode, LoRA adapters, unmanaged modules such as norms) the master is the Parameter itself and nothing is
copied, so one helper serves every engine."""

from __future__ import annotations

import torch


class Masters:
    def __init__(self, params, placed_like=None):
        """`params`: what autograd trains (their `.grad` is filled by backward). `placed_like`: the managed
        model's parameters in the same order (default: `params` themselves, for the managed model)."""
        self.params = list(params)
        like = self.params if placed_like is None else list(placed_like)
        assert len(like) == len(self.params), "the reference and the managed model train different parameters"
        self.masters = [
            p if p.device == q.device else torch.nn.Parameter(p.detach().to(q.device, copy=True), p.requires_grad)
            for p, q in zip(self.params, like)
        ]
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}

    def master_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        return self._master_of[id(param)]

    def take_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """`param`'s gradient on its master's device, taken out of `param.grad` (as a fused step does)."""
        grad, param.grad = param.grad, None
        return None if grad is None else grad.to(self.master_of(param).device)

    def grads_to_masters(self) -> None:
        """Every gradient moved to its master, where the optimizer reads it."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = self.take_grad(p)

    def masters_to_params(self, param: torch.nn.Parameter | None = None) -> None:
        """The masters' values (after a step or an EMA swap) copied into the parameters that compute."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p and (param is None or p is param):
                    p.copy_(m)
