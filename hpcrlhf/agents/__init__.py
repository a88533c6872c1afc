"""Agents: multi-turn rollouts in which the model calls tools and an environment answers it.

What a user writes is plain Python, named in the job's `agent` section (`docs/agents.md`):

- an environment class (`agent.environment: package.module:Class`): `reset(row, seed)` gives the
  first message, `step(action)` judges each answer without tool calls (`Step`), and its methods
  marked `@tool` are tools the model may call;
- tools (`agent.tools: [package.module:function]`): typed functions with Google-style docstrings,
  whose JSON schema the chat template shows the model;
- optionally a tool-call parser (`agent.tool_parser`); Hermes-style `<tool_call>{json}</tool_call>`
  by default.

Modules: `contract` (what an environment returns, checked), `tools` (schemas, calls and their
answers), `parsers` (tool calls in a turn), `render` (prompts and observations as tokens: the chat
template's difference after the model's EOS), `environments` (loading the class), `episode` (one
trajectory and the rule after each turn), `record` (what a trajectory was), `pool` (environment and
tool calls on threads, with deadlines), `scheduler` (a batch of trajectories, each on its own clock,
on a request-level engine), `requests` (that engine on vLLM and on Hugging Face generate), `runner`
(a job's agent section loaded once; prompt rows run as groups of trajectories) and `metrics` (a
rollout's agent/* figures).
The package sits above the rollout engines (`hpcrlhf.engines`) and below the trainers.
"""

from hpcrlhf.agents.contract import Step, tool

__all__ = ["Step", "tool"]
