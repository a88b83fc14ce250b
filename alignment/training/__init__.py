"""The machinery of a Megatron training step, shared by every trainer (:mod:`alignment.trainers`):
DDP and the optimizer, forward-backward at any layout (:mod:`.megatron_step`), batches and
micro-batches, balancing over data-parallel ranks, the output layer on the positions a loss reads,
health checks, gradient and router statistics, offloading idle models, and atomic checkpoints."""
