"""Agents: multi-turn rollouts in which the model calls tools and an environment answers it.

What a user writes is plain Python, named in the job's `agent` section (`docs/agents.md`):

- an environment class (`agent.environment: package.module:Class`): `reset(row, seed)` gives the
  first message, `step(action)` judges each answer without tool calls (`Step`), and its methods
  marked `@tool` are tools the model may call;
- tools (`agent.tools: [package.module:function]`): typed functions with Google-style docstrings,
  whose JSON schema the chat template shows the model;
- optionally a tool-call parser (`agent.tool_parser`); Hermes-style `<tool_call>{json}</tool_call>`
  by default.

This package holds the contract (`contract`), tools (`tools`), parsers (`parsers`), the renderer of
prompts and observations into tokens (`render`) and the pool of
threads environment and tool calls run on, each with a deadline (`pool`).
"""

from hpcrlhf.agents.contract import Step, tool

__all__ = ["Step", "tool"]
