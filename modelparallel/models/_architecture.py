"""One architecture record: everything modelparallel knows about one Hugging Face ``model_type``.

Before this record each kind of knowledge had its own table keyed by ``model_type`` (plans, key
tables, pipeline splits, context and expert data, SageMaker names); a reader had to visit six
of them to see one model, and nothing outside the package could add a model. A record is plain
data; the package builds one per file of ``modelparallel/models`` and ``register_architecture``
adds one for a user's model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..context.spec import ContextSpec
from ..expert.layout import ExpertLayout
from ._translate import KeyTable
from ..pipeline.split import PipelineSplit
from ..tp.plan import ArchSpec
from ._sagemaker import SageMakerLayout


@dataclass(frozen=True)
class Architecture:
    """One HF architecture's data, for every parallel dimension.

    Attributes:
        spec: the tensor-parallel plan (``ArchSpec``); its ``model_type`` names the architecture.
        table: the state-dict key table (HF keys <-> the distributed format), or None: then
            checkpoints hold the model's own keys and no HF export is offered.
        pipeline: where the model cuts into pipeline stages, or None: pipeline parallelism is
            refused for it.
        context: the attention modules context parallelism replaces (a decoder or an encoder), or None:
            context parallelism is refused for it.
        experts: a mixture-of-experts model's experts and routers, or None (a dense model).
        sagemaker: where SageMaker's module names (``seq_layers``...) fall in it, or None.
    """

    spec: ArchSpec
    table: KeyTable | None = None
    pipeline: PipelineSplit | None = None
    context: ContextSpec | None = None
    experts: ExpertLayout | None = None
    sagemaker: SageMakerLayout | None = None

    def __post_init__(self):
        kinds = (("spec", ArchSpec), ("table", KeyTable), ("pipeline", PipelineSplit), ("context", ContextSpec),
                 ("experts", ExpertLayout), ("sagemaker", SageMakerLayout))
        for name, kind in kinds:
            value = getattr(self, name)
            if not isinstance(value, kind) and not (value is None and name != "spec"):
                raise TypeError(f"Architecture.{name} must be a {kind.__name__}"
                                f"{'' if name == 'spec' else ' or None'}, got {type(value).__name__}")
        if self.table is not None and self.table.arch != self.spec.model_type:
            raise ValueError(f"Architecture: the key table is for model_type {self.table.arch!r}, the plan for "
                             f"{self.spec.model_type!r}")

    @property
    def model_type(self) -> str:
        """The HF ``config.model_type`` this record serves."""
        return self.spec.model_type
