"""Host <-> device copies that never wait for the GPU: what lets the host prepare step n+1 while step n runs.

A copy between pageable host memory and a GPU waits for every kernel queued before it: `torch.tensor(ids,
device="cuda")` made after a step's forward was launched returns only once that forward is done, and so does
`tokens.tolist()`. The engine's overlapped steps (engine.py, `async_scheduling`) queue step n+1 before reading
step n's tokens, so both directions go through page-locked ("pinned") memory instead:

  - `to_device`: host ints -> a device tensor, by one copy queued behind the running work (torch's pinned
    memory allocator keeps the host buffer until the copy has run);
  - `DeviceTokens`: a step's sampled tokens, kept on the device (the next step's input ids are read from
    there, with no round trip) and copied to a pinned host buffer as soon as they are drawn; `tolist()` waits
    for that copy alone, not for the kernels queued after it.

On a CPU every op has run when it returns: both are plain tensors there, and the tests exercise the same calls.
"""

import torch


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """values as an int64 tensor on device, copied without waiting for the device's queued work."""
    host, device = torch.tensor(values, dtype=torch.long), torch.device(device)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class DeviceTokens:
    """One step's sampled tokens: `on_device` (R,) for the next step's inputs, `tolist()` for the host."""

    def __init__(self, tokens: torch.Tensor):
        self.on_device = tokens
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = tokens, None

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # the draw and its copy; not the step queued after them
        return self.host.tolist()
