"""The whole tensor of a sharded state, for tests that compare states across meshes
(tests/reshard_check.py under torchrun, tests/test_master_remainder.py in gloo ranks)."""

import torch
from torch.distributed.tensor import DTensor

# Collectives gloo and NCCL lack: the int16 master_remainder state and fp8 codes travel
# widened to int32 (fp8 by its bits) and come back exact.
_NO_COLLECTIVES = (torch.int16, torch.float8_e4m3fn)


def whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full size, every dtype bit for bit; a plain tensor as it is."""
    if not isinstance(value, DTensor):
        return value.detach()
    if value.dtype not in _NO_COLLECTIVES:
        return value.full_tensor()
    local = value.to_local()
    bits = local.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else local
    wide = DTensor.from_local(bits.to(torch.int32), value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride()).full_tensor()
    return wide.to(torch.uint8).view(value.dtype) if value.dtype == torch.float8_e4m3fn else wide.to(torch.int16)
