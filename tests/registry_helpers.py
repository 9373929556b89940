"""Tests that need a model type to look as if its architecture file did not exist."""

from types import MappingProxyType

import modelparallel.models as registry


class FileRemoved:
    """The built-in records without ``model_type``'s, as if its file did not exist."""

    def __init__(self, model_type):
        self.model_type = model_type

    def __enter__(self):
        self.saved = registry.BUILT_IN
        registry.BUILT_IN = MappingProxyType({t: a for t, a in self.saved.items() if t != self.model_type})

    def __exit__(self, *exc):
        registry.BUILT_IN = self.saved
