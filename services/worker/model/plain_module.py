"""nn.Module called as a plain function, with plain attribute reads.

A decode step of a small model on the CPU is a few hundred tiny ops, and the framework around each costs about as
much as the op. Two of those costs are nn.Module's, and serving needs neither:
- __call__ runs hook bookkeeping before forward (the demo model's projections and MLPs alone: ~0.1 ms of a 1.8 ms
  step). Serving registers no hooks, so these modules go straight to forward.
- reading a parameter or submodule (self.weight, self.mlp) misses the instance dict and falls back to
  nn.Module.__getattr__'s search of _parameters and _modules (~60 reads a step: ~3% of it). `freeze_lookups`
  puts them in the instance dict once the model is loaded and laid out. Registering or moving them later keeps
  working: nn.Module.__setattr__ drops the instance-dict copy of a name it registers, and `_apply` (`.to()`,
  `.float()`) thaws the module, applies, and freezes it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class PlainModule(nn.Module):
    """An nn.Module whose call is its forward (no hooks are consulted) and whose parameters and submodules can be
    frozen into plain attributes."""

    _frozen = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def freeze_lookups(self) -> None:
        """Copies this module's and every PlainModule descendant's parameters and submodules into their instance
        dicts."""
        for module in self.modules():
            if isinstance(module, PlainModule):
                module._freeze()

    def _freeze(self) -> None:
        self.__dict__.update(self._parameters)
        self.__dict__.update(self._modules)
        self._frozen = True

    def _thaw(self) -> None:
        for name in (*self._parameters, *self._modules):
            self.__dict__.pop(name, None)
        self._frozen = False

    def _apply(self, fn: Callable, recurse: bool = True) -> PlainModule:
        if not self._frozen:
            return super()._apply(fn, recurse)
        self._thaw()
        super()._apply(fn, recurse)
        self._freeze()
        return self
