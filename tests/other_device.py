"""A tensor that says it lives on another device, for checking on a CPU-only machine that code moves
what it builds to the model's device.

`Elsewhere(t)` holds `t`'s CPU data but reports `device='cuda:0'`. It behaves as torch does across
devices: an op mixing it with a CPU tensor raises torch's own message ("Expected all tensors to be on
the same device, but found at least two devices, cuda:0 and cpu!"), except a CPU 0-dim tensor, which
torch lets a CUDA op read; ops among `Elsewhere` tensors stay `Elsewhere`; `.to('cpu')` / `.cpu()`
hand back the plain data. So a model on the CPU fed `Elsewhere` inputs fails exactly where a cuda
model fed CPU inputs fails, and works once the inputs go through a `.to(model_device)`."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda:0")


class Elsewhere(torch.Tensor):
    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=DEVICE,
                                                   strides=data.stride(), requires_grad=False)

    def __init__(self, data: torch.Tensor):
        self.data_ = data

    def item(self):  # a host read, as on cuda (torch's own would look for a CUDA device first)
        return self.data_.item()

    def __float__(self):
        return float(self.data_)

    def tolist(self):
        return self.data_.tolist()

    def __getitem__(self, index):  # torch's own indexing takes a CUDA device guard first
        return Elsewhere(self.data_[tree_map(_unwrap, index)])

    def __repr__(self):
        return f"Elsewhere({self.data_!r}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            return func(args[0].data_, **{k: v for k, v in kwargs.items() if k != "device"})
        flat, _ = tree_flatten((args, kwargs))
        other = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, Elsewhere)
                 and (t.dim() > 0 or t.device.type != "cpu")]
        if other:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and {other[0].device}!")
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(lambda t: Elsewhere(t) if isinstance(t, torch.Tensor) else t, out)


def _unwrap(t):
    return t.data_ if isinstance(t, Elsewhere) else t


def elsewhere(x):
    """`x` (a tensor, or a dataclass / dict / list holding tensors) with its tensors made `Elsewhere`."""
    import dataclasses
    if isinstance(x, torch.Tensor):
        return Elsewhere(x)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: elsewhere(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if isinstance(getattr(x, f.name), torch.Tensor)})
    if isinstance(x, dict):
        return {k: elsewhere(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(elsewhere(v) for v in x)
    return x
