"""Placement: the static node map of a PPO job (roles -> nodes and GPUs, vLLM TP groups,
colocation), its memory estimate and its checks, all before anything starts. Pure Python."""

from hpcrlhf.placement.layout import Device
from hpcrlhf.placement.memory import MemoryParts
from hpcrlhf.placement.nodemap import NodeMap, Occupant, build_node_map
from hpcrlhf.placement.render import render_text
from hpcrlhf.placement.shapes import ModelShape, shape_of

__all__ = ["Device", "MemoryParts", "ModelShape", "NodeMap", "Occupant", "build_node_map", "render_text", "shape_of"]
