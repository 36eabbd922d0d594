"""A pickle reader that executes nothing: every global is refused.

Real memory snapshots hold only dicts, lists, tuples, strings, numbers, bools
and None, which pickle encodes without any global; anything that asks for one
(os.system, builtins.eval, a torch class) is not a snapshot.
"""
from __future__ import annotations

import pickle


class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module, name):
        self.module, self.name = module, name
        super().__init__(f"{module}.{name}")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler whose find_class refuses everything (so REDUCE, BUILD, EXT... cannot run code)."""

    def find_class(self, module, name):
        raise RefusedGlobal(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed")


def restricted_load(fileobj):
    """Unpickle plain builtins from a binary file object; raises on any global."""
    return RestrictedUnpickler(fileobj).load()
