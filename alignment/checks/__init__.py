"""Each algorithm's checks across sections (its section's values with the rollout, data, reward, trainer and
parallel sections, the layout and the model), beside one another: one module per algorithm, whose ``validate(cfg,
layout, dims)`` its record names (:attr:`alignment.algorithms.registry.Algorithm.validate`).
:func:`alignment.config.validate` calls it after the checks every job shares, before any process group starts.
``cfg``: the :class:`alignment.config.JobConfig`; ``layout``: the trainers' :class:`parallel.layout.ParallelLayout`;
``dims``: the model's :class:`alignment.models.dims.ModelDims`. Each raises
:class:`alignment.schema.ConfigError` naming the field and the fix."""

from __future__ import annotations

#: the error for an algorithm whose ranks train on different numbers of rows, at expert parallelism
VARIABLE_ROWS_EP = ("parallel.expert_model_parallel_size > 1: algorithm.name={name} trains on however many {what} "
                    "each data-parallel rank has, so ranks run different numbers of micro-batches, and the experts' "
                    "all-to-all spans data-parallel ranks; set expert_model_parallel_size=1 for now")
