"""Memory at long sequences, applied to the model from outside (trainer/parallelize.py), none changing the result:

- `tile_feed_forward`: the MLP runs over slices of the sequence, each slice recomputed in backward, so its
  [tokens, ffn] intermediate (the largest activation of a long sequence) never spans the whole sequence
  (Arctic Long Sequence Training's TiledMLP);
- `offloading_checkpoint`: activation checkpointing whose block input (the one tensor a recomputed block keeps)
  waits in host memory between forward and backward, so the device holds one block's activations whatever the
  depth. On CUDA the copy goes to pinned memory on a side stream (behind a one-time check that the round trip
  is exact); on the CPU the same hooks copy into a separate buffer, so the path is tested there.

The tiled loss is models/loss.py's chunked cross-entropy, sliced by --loss-tile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def tile_feed_forward(feed_forward: nn.Module, tile: int) -> None:
    """Make `feed_forward` (x [batch, seq, dim] -> [batch, seq, dim], position-wise) compute `tile` tokens at a
    time, each slice's intermediates dropped after forward and recomputed in its backward; in place, its
    parameters' names unchanged."""
    whole = feed_forward.forward

    def tiled(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] <= tile:
            return whole(x)
        slices = [checkpoint(whole, x[:, start:start + tile], use_reentrant=False)  # [batch, tile, dim]
                  for start in range(0, x.shape[1], tile)]
        return torch.cat(slices, dim=1)  # [batch, seq, dim]

    feed_forward.forward = tiled


class HostCopy:
    """A tensor's copy in host memory: on CUDA pinned and written on a side stream, so forward does not wait."""

    def __init__(self, tensor: torch.Tensor, checked: bool = True):
        self.device, self.requires_grad = tensor.device, tensor.requires_grad
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            self.host, self.copied = tensor.clone(), None  # the CPU: a separate buffer, the same hooks
            return
        if checked:
            check_offload(tensor.device)
        stream = side_stream(tensor.device)
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            self.host.copy_(tensor, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        tensor.record_stream(stream)  # its memory is not reused before the copy is done

    def back(self) -> torch.Tensor:
        """The tensor on its device again, requiring grad as it did."""
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
        tensor = self.host.to(self.device, non_blocking=True) if self.device.type == "cuda" else self.host.clone()
        return tensor.requires_grad_(self.requires_grad)


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.cache
def check_offload(device: torch.device) -> None:
    """Once per device: a round trip through pinned memory on the side stream gives back the same bytes;
    refuse --offload-activations where it does not."""
    sample = torch.randn(1 << 20, device=device)
    if not torch.equal(HostCopy(sample, checked=False).back(), sample):
        raise RuntimeError(f"--offload-activations: a copy to pinned host memory and back on {device} changed the "
                           f"values; run without --offload-activations")


def offloading_checkpoint(options: dict) -> Callable:
    """A `checkpoint_fn` for checkpoint_wrapper: torch's non-reentrant checkpoint with `options` (selective's
    context_fn), whose block input waits in host memory. The forward uses the device input as it is; when
    backward reaches the block's output, a hook brings the input back, and the recomputation starts from it
    (outside the recomputed region, which selective checkpointing replays op by op)."""

    def run(block: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():  # a forward without backward keeps nothing
            return block(x, *args, **kwargs)
        inputs = [x]  # the forward run takes it; the hook puts the copy brought back
        saved = HostCopy(x)

        def from_host(_: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return block(inputs.pop(), *args, **kwargs)

        out = checkpoint(from_host, saved.host, *args, use_reentrant=False, **options, **kwargs)
        out.register_hook(lambda grad: inputs.append(saved.back()))
        return out

    return run
