"""The bottom layer: process groups, layouts, parallel layers, reshard and packing; it knows no model."""

from parallel import lazy_compile

lazy_compile.install()  # before any Megatron import: its torch.compile decorations compile at first call
