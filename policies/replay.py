"""Fixed-size replay buffer of tensors on the training device (ring buffer, uniform sampling)."""

from __future__ import annotations

import torch


class ReplayBuffer:
    def __init__(self, capacity: int, shapes: dict[str, tuple[int, ...]], device: torch.device):
        self.capacity, self.device = capacity, device
        self.data = {k: torch.zeros((capacity, *s), device=device) for k, s in shapes.items()}
        self.ptr, self.size = 0, 0

    def add(self, **batch: torch.Tensor) -> None:
        n = next(iter(batch.values())).shape[0]
        idx = (self.ptr + torch.arange(n, device=self.device)) % self.capacity
        for k, v in batch.items():
            self.data[k][idx] = v.reshape(n, *self.data[k].shape[1:]).float()
        self.ptr = (self.ptr + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, self.size, (n,), generator=gen, device=self.device)
        return {k: v.index_select(0, idx) for k, v in self.data.items()}  # ~4x faster than v[idx] on CPU

    def state_dict(self) -> dict:
        return {"data": {k: v[: self.size].clone() for k, v in self.data.items()}, "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, d: dict) -> None:
        self.ptr, self.size = d["ptr"], d["size"]
        for k, v in d["data"].items():
            self.data[k][: self.size] = v.to(self.device)
