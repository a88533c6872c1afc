"""Ray clusters and the worker groups placed on them by the node map (hpcrlhf.placement)."""
