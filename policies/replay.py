"""Fixed-size replay buffer of tensors on the training device (ring buffer, uniform sampling).

Checkpoints: by default :meth:`ReplayBuffer.state_dict` holds the buffer's rows. A trainer that
checkpoints often calls :meth:`ReplayBuffer.persist` first; the rows then go to segment files in
that directory, each save writing only the rows added since the one before, and the state dict
holds just the counters. A full quad_hover SAC buffer (1M transitions, 592 MB) took 2.3 s to
write at every checkpoint; a segment holds one checkpoint interval's transitions.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .checkpoint import CheckpointError, save_atomic

SEGMENT = re.compile(r"rows_(\d{12})_(\d{12})\.pt")


class ReplayBuffer:
    def __init__(self, capacity: int, shapes: dict[str, tuple[int, ...]], device: torch.device):
        self.capacity, self.device = capacity, device
        self.data = {k: torch.zeros((capacity, *s), device=device) for k, s in shapes.items()}
        self.total = 0  # rows ever added; row t sits at t % capacity until overwritten
        self.directory: Path | None = None
        self._saved = 0  # self.total at the last state_dict() since persist() or a load

    @property
    def ptr(self) -> int:
        """Where the next row goes."""
        return self.total % self.capacity

    @property
    def size(self) -> int:
        """Rows held."""
        return min(self.total, self.capacity)

    def add(self, **batch: torch.Tensor) -> None:
        n = next(iter(batch.values())).shape[0]
        idx = (self.ptr + torch.arange(n, device=self.device)) % self.capacity
        for k, v in batch.items():
            self.data[k][idx] = v.reshape(n, *self.data[k].shape[1:]).float()
        self.total += n

    def sample(self, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, self.size, (n,), generator=gen, device=self.device)
        return {k: v.index_select(0, idx) for k, v in self.data.items()}  # ~4x faster than v[idx] on CPU

    def persist(self, directory: Path) -> None:
        """Keep the rows in segment files under ``directory`` from now on (see the module's text)."""
        self.directory = Path(directory)
        self._saved = 0

    def state_dict(self) -> dict:
        """The buffer's state. Persisted: first writes the rows added since the last call to a
        segment file, and deletes the segments that neither this state nor the previous one needs
        (the previous state may still be the one on disk while this one is being written). So a
        persisted buffer's state is taken once per checkpoint, and that checkpoint is then written."""
        counters = {"ptr": self.ptr, "size": self.size, "total": self.total}
        if self.directory is None:
            return {"data": {k: v[: self.size].clone() for k, v in self.data.items()}, **counters}
        self.directory.mkdir(parents=True, exist_ok=True)
        for start, end, path in self._segments():
            # Written by a run that was killed before its checkpoint referred to them (a resumed
            # run writes those rows again), or overwritten in the ring before the previous state.
            if start >= self._saved or end <= self._saved - self.capacity:
                path.unlink()
        for partial in self.directory.glob("rows_*.pt.tmp"):  # a write that a kill interrupted
            partial.unlink()
        start = max(self._saved, self.total - self.capacity)
        if start < self.total:
            rows = torch.arange(start, self.total, device=self.device) % self.capacity
            save_atomic({k: v.index_select(0, rows).cpu() for k, v in self.data.items()},
                        self.directory / f"rows_{start:012d}_{self.total:012d}.pt")
        self._saved = self.total
        return counters

    def load_state_dict(self, d: dict) -> None:
        """Restore a state of :meth:`state_dict`; a persisted one reads its rows from the segment
        files. One missing, unreadable or of the wrong shape is a
        :class:`policies.checkpoint.CheckpointError`; loading writes and deletes no file."""
        size = d["size"]
        # States of older revisions lack the count; any count with the same ring position serves.
        total = d.get("total", size if size < self.capacity else self.capacity + d["ptr"])
        if "data" in d:  # the rows themselves (persisted, the next state writes them all to a segment)
            for k, v in d["data"].items():
                self.data[k][:size] = v.to(self.device)
            self._saved = total - size
        else:
            self._load_segments(total - size, total)
            self._saved = total
        self.total = total

    def _load_segments(self, first: int, total: int) -> None:
        """Rows ``first``..``total`` from the segment files into the ring: the segments are found
        (or the missing rows named) before any row is read."""
        if self.directory is None:
            raise CheckpointError("this checkpoint keeps its replay rows in segment files and no directory was given")
        needed, covered = [], first
        for start, end, path in self._segments():
            lo, hi = max(start, first), min(end, total)
            if lo >= hi:  # overwritten in the ring, or written after this state
                continue
            if lo > covered:
                break
            needed.append((start, end, lo, hi, path))
            covered = max(covered, hi)
        if covered < total:
            raise CheckpointError(f"the replay rows {covered:,}..{total:,} of this checkpoint are missing from "
                                  f"{self.directory}; no file was changed")
        for start, end, lo, hi, path in needed:
            try:
                seg = torch.load(path, map_location="cpu", weights_only=True)
                ok = set(seg) == set(self.data) and all(v.shape == (end - start, *self.data[k].shape[1:])
                                                         for k, v in seg.items())
            except Exception as e:  # torch raises many types for truncated/garbled files
                raise CheckpointError(f"replay segment {path} is corrupt or unreadable ({type(e).__name__}); "
                                      f"no file was changed") from None
            if not ok:
                raise CheckpointError(f"replay segment {path} does not hold rows {start:,}..{end:,} of this buffer; "
                                      f"no file was changed")
            rows = torch.arange(lo, hi, device=self.device) % self.capacity
            for k, v in self.data.items():
                v[rows] = seg[k][lo - start: hi - start].to(self.device)

    def _segments(self) -> list[tuple[int, int, Path]]:
        """(first row, end row, path) of every segment file, in order of first row."""
        if self.directory is None or not self.directory.is_dir():
            return []
        found = (SEGMENT.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted((int(m[1]), int(m[2]), self.directory / m[0]) for m in found if m)
