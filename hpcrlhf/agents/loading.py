"""The user's code an `agent` section names -- its environment class, tools and tool-call parser --
listed and imported before a job is written or queued (`hpcrlhf.hpc.job.check_user_code`), as the
job will import it when it starts (`AgentRunner`): a module missing on this Python, one that raises
on import, or a name that is no class or function fails with the field named, not on the nodes after
the queue."""

from __future__ import annotations

from typing import Any

from hpcrlhf.agents.environments import load_environment
from hpcrlhf.agents.parsers import BUILTIN_PARSERS, load_parser
from hpcrlhf.agents.tools import load_tools
from hpcrlhf.config.schema.agent import AgentConfig


def agent_section(cfg: Any) -> AgentConfig | None:
    """The agent section of a job or generate config (None: none, or a job kind without one)."""
    agent = getattr(cfg, "agent", None)
    return agent if isinstance(agent, AgentConfig) else None


def agent_code_names(cfg: Any) -> list[tuple[str, str]]:
    """(config field, name) of every `package.module:name` the config's agent section names."""
    agent = agent_section(cfg)
    if agent is None:
        return []
    names = [("agent.environment", agent.environment)] if agent.environment else []
    names += [(f"agent.tools[{i}]", name) for i, name in enumerate(agent.tools)]
    if agent.tool_parser not in BUILTIN_PARSERS:
        names.append(("agent.tool_parser", agent.tool_parser))
    return names


def check_agent_code(cfg: Any) -> None:
    """Import and check what the config's agent section names, as `AgentRunner` will (a ConfigError
    names the field): the environment class (its `reset`, the arguments it takes, its tools' schemas),
    the tools and the parser."""
    agent = agent_section(cfg)
    if agent is None:
        return
    data = getattr(cfg, "data", None)
    load_environment(agent.environment, agent.environment_args, getattr(data, "prompt_key", "prompt"))
    load_tools(agent.tools)
    load_parser(agent.tool_parser)
