"""Using a trained model: batch generation over a dataset (`hpcrlhf generate`) and an
interactive chat (`hpcrlhf chat`).

`generate` answers every prompt of a dataset (or the bundled task's held-out prompts) with the
rollout engine of PPO (HF generate or vLLM), optionally scores each response with reward models
and rules (the same `reward` section as PPO) and with the user's `metrics` (the contract of
`eval.metrics`), and writes one JSON line per response. It prints a summary: the mean of the
combined score, of each reward source, of each metric, and the task score on the bundled task.
With an `agent` section each prompt row runs as a multi-turn trajectory (`AgentRunner`, as ppo's
rollouts do): its line holds the transcript and what happened in it, the summary the agent's means.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO, TextIO

import torch

from hpcrlhf.agents.environments import load_environment
from hpcrlhf.agents.parsers import load_parser
from hpcrlhf.agents.pool import EnvPool
from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.agents.runner import AgentRunner
from hpcrlhf.agents.tools import ToolAnswer, ToolBox, load_tools
from hpcrlhf.agents.scheduler import mixed_seed
from hpcrlhf.config.schema import GenerateConfig, RolloutConfig
from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.data.loading import held_out_prompt_rows, load_train_rows, require_task_prompts, task_note
from hpcrlhf.data.prompts import encode_prompt_rows, episode_rows
from hpcrlhf.data.sft import encode_prompt
from hpcrlhf.data.sources import require_text
from hpcrlhf.data.tasks import build_task
from hpcrlhf.engines.deepspeed_engine import FrozenModel
from hpcrlhf.engines.distributed import device_for
from hpcrlhf.engines.rollout import SamplingParams
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.engines.rollout.settings import sampling_params, vllm_rollout_args
from hpcrlhf.engines.rollout.vllm import VLLMRollout
from hpcrlhf.errors import AgentEnvError, ConfigError, DataError
from hpcrlhf.logs import Progress, get_logger
from hpcrlhf.models.context import ContextWindow, require_generation_fits
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from hpcrlhf.models.value import ValueModel, load_value_model
from hpcrlhf.rewards.rules import EvalMetrics, check_rules
from hpcrlhf.rewards.sources import RewardSet
from hpcrlhf.run.diskspace import out_of_space_is_an_error
from hpcrlhf.run.files import make_folders, replacing, require_safe
from hpcrlhf.trainers.online import answer, flatten_generations, judged

log = get_logger()


def load_generator(path: str, backend: str, *, max_model_len: int, rollout: RolloutConfig | None = None, seed: int = 0,
                   trust_remote_code: bool = False, attn_implementation: str = "auto", tokenizer=None,
                   local_rank: int = 0):
    """(rollout engine, tokenizer) for a model folder; `rollout` holds the vLLM engine's settings
    (KV cache, batching; None: the defaults); `tokenizer`: the model's, loaded already; `local_rank`:
    the HF engine's GPU on this node."""
    if tokenizer is None:
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    if backend == "vllm":
        return VLLMRollout(resolve_model_path(path), seed=seed, max_model_len=max_model_len,
                           **vllm_rollout_args(rollout or RolloutConfig())), tokenizer
    device = device_for(local_rank)
    model = load_causal_lm(path, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code).to(device)
    return HFRollout(model.eval(), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                     device=device), tokenizer


def run_generate(cfg: GenerateConfig) -> dict:
    out = Path(cfg.output)
    require_safe(out, fix="name another file with -o (--output)")  # a folder, /dev/full, a link: before loading
    make_folders(out.parent, "-o (--output)")
    window = require_generation_fits(cfg)
    torch.manual_seed(cfg.seed)
    note = task_note(cfg.task, cfg.data)
    if note:
        log.info(note)
    check_rules(cfg)  # the user's code is imported before the model loads
    task = build_task(cfg.task, cfg.data)
    metrics = EvalMetrics(cfg.metrics, task, "metrics", cfg.metric_timeout_s, "metric_timeout_s", cfg.rules)
    # The prompts file, else the held-out prompts (data.eval_path, or the bundled task's held-out split:
    # never its training prompts).
    if cfg.data.train_path:
        rows, key = load_train_rows(cfg.data, cfg.task, lambda t, split, n: t.prompt_rows(split, n)), cfg.data.prompt_key
        if cfg.agent is None:  # a trajectory's first message is the environment's (its reset reads the row)
            require_text(rows, (key,), key_option={key: "data.prompt_key"})
        require_task_prompts(rows, key, cfg.task, cfg.data)
    else:
        rows, key = held_out_prompt_rows(cfg.data, cfg.task)
    r = cfg.rollout
    tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    agent = None if cfg.agent is None else AgentRunner(cfg.agent, tokenizer, chat=cfg.data.apply_chat_template,
                                                       prompt_key=key, max_prompt_tokens=cfg.data.max_length)
    prompts = encode_prompt_rows(rows, cfg.data, tokenizer, key) if agent is None else episode_rows(rows, key)
    window.require_prompts_fit(((len(p.ids), p.origin) for p in prompts), "rollout.max_new_tokens", r.max_new_tokens)
    longest = max(r.max_new_tokens, cfg.agent.max_tokens if cfg.agent else 0)
    engine, tokenizer = load_generator(cfg.model.path, r.backend, max_model_len=cfg.data.max_length + longest,
                                       rollout=r, seed=cfg.seed, tokenizer=tokenizer,
                                       trust_remote_code=cfg.model.trust_remote_code,
                                       attn_implementation=cfg.model.attn_implementation)
    device = device_for(0)
    rewards = None
    if cfg.reward is not None:
        def load_rm(path: str, field: str) -> FrozenModel:
            return FrozenModel(ValueModel(load_value_model(path, pad_token_id=tokenizer.pad_token_id, key=field,
                                                           trust_remote_code=cfg.model.trust_remote_code)), None, device)

        rewards = RewardSet(cfg.reward, load_rm, tokenizer, task, device, cfg.model.trust_remote_code, cfg.rules)
    params = sampling_params(r, n=r.samples_per_prompt, greedy=cfg.greedy, seed=None if cfg.greedy else cfg.seed)
    totals: dict[str, Any] = {}
    count = reported = 0
    progress = Progress(len(prompts), desc="generate")
    # written beside `out` and renamed over it when complete: never half a file, never through a link
    with out_of_space_is_an_error(out.parent, out.name), replacing(out) as f:
        for start in range(0, len(prompts), cfg.batch_size):
            batch = prompts[start : start + cfg.batch_size]
            if agent is None:
                gens = engine.generate([list(p.ids) for p in batch], params)
            else:  # each row's environment seeded by the seed and the row's place in the file
                gens, _ = agent.run(engine, [p.row for p in batch], params, env_seed=mixed_seed(cfg.seed, start),
                                    origins=[p.origin for p in batch])
            records = _records(batch, gens, tokenizer, metrics, rewards)
            for rec in records:
                f.write((json.dumps(rec) + "\n").encode())
                _add(totals, {k: v for k, v in rec.items() if k in MEANS})
                reported += "success" in rec
            count += len(records)
            progress.update(len(batch))
    progress.close()
    engine.close()
    if agent is not None:
        agent.close()
    summary = {"responses": count, "output": str(out),
               **{f"mean_{k}": _divided(v, max(reported if k == "success" else count, 1)) for k, v in totals.items()}}
    log.info("generate: " + ", ".join(_shown(k, v) for k, v in summary.items()))
    return summary


MEANS = ("score", "task_score", "scores", "metrics", "turns", "tool_calls", "episode_reward", "success", "truncated")
"""The fields of a response's record whose means `generate` reports (`mean_<field>`): the combined
score, the task score, each reward source's score and each of `metrics`; of a trajectory, its turns,
tool calls, the environment's reward, whether it was cut at agent.max_turns or max_tokens, and its
success (over the trajectories whose environment reported it, as agent/success in training)."""


def _add(totals: dict[str, Any], values: dict[str, Any]) -> None:
    """Add a record's numbers (or {name: number} of them) into running totals of the same shape."""
    for key, value in values.items():
        if isinstance(value, dict):
            _add(totals.setdefault(key, {}), value)
        else:
            totals[key] = totals.get(key, 0.0) + value


def _divided(total: Any, n: int) -> Any:
    return {k: _divided(v, n) for k, v in total.items()} if isinstance(total, dict) else total / n


def _shown(key: str, value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(_shown(f"{key}.{k}", v) for k, v in value.items())
    return f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}"


def _records(batch, gens, tokenizer, metrics, rewards) -> list[dict]:
    _, flat, responses = flatten_generations(batch, gens, tokenizer)
    samples = [j for g in gens for j in range(len(g))]
    records = [{"prompt": r.prompt, "response": answer(r), "sample": j, "finished": g.finished,
                "num_tokens": len(g.response_ids), "logprob": float(sum(g.logprobs)), **_trajectory(g)}
               for r, g, j in zip(responses, flat, samples)]
    values = metrics.values(judged(responses))
    task_scores = values.pop("task_score", None)
    for i, rec in enumerate(records):
        if task_scores is not None:
            rec["task_score"] = task_scores[i]
        if values:
            rec["metrics"] = {name: v[i] for name, v in values.items()}
    if rewards is not None:
        total, parts = rewards.score(responses)
        for i, rec in enumerate(records):
            rec["score"] = float(total[i])
            rec["scores"] = {name: float(v[i]) for name, v in parts.items()}
    return records


def _trajectory(g) -> dict[str, Any]:
    """What a multi-turn generation's line adds: its transcript and what happened in it (empty for a
    single-turn response). `num_tokens` and `logprob` then count the model's tokens alone."""
    e = g.episode
    if e is None:
        return {}
    out = {"messages": e.messages, "status": e.status, "turns": e.turns, "tool_calls": sum(e.tool_calls.values()),
           "tool_calls_by_tool": dict(e.tool_calls), "tool_errors": dict(e.tool_errors), "episode_reward": e.reward,
           "truncated": float(e.truncated), "num_tokens": sum(g.action_mask)}
    if e.success is not None:
        out["success"] = float(e.success)
    if e.error:
        out["error"] = e.error
    return out


BLOCK = '"""'
"""Three double quotes open and close a chat message of several lines (as in Ollama's REPL)."""


MAX_LINE_BYTES = 1 << 20
"""The longest line chat reads (1 MiB): a message is far shorter, and a line is read whole before anything
checks it (a pipe of a file with no line breaks would fill the memory first)."""


class Utf8Lines:
    """The lines of a binary stream (chat's stdin) as UTF-8 text. A line that is not UTF-8, or longer than
    `MAX_LINE_BYTES`, is a DataError naming its number, before any of it is tokenized: text-mode stdin
    decodes by the locale, and binary input reached the tokenizer as lone surrogates (a TypeError)."""

    def __init__(self, raw: BinaryIO, name: str = "stdin"):
        self.raw, self.name, self.number = raw, name, 0

    def isatty(self) -> bool:
        return self.raw.isatty()

    def readline(self) -> str:
        data = self.raw.readline(MAX_LINE_BYTES + 1)
        if not data:
            return ""
        self.number += 1
        where = f"{self.name} line {self.number}"
        if len(data) > MAX_LINE_BYTES and not data.endswith(b"\n"):
            raise DataError(f"{where} is longer than {MAX_LINE_BYTES >> 20} MiB: chat reads a message per line; "
                            "split the text into shorter messages (or pipe in text, not a binary file)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where} is not UTF-8 text (byte {data[e.start]:#04x} at byte {e.start + 1} of the "
                            "line): chat reads UTF-8 text; convert it first (e.g. iconv -t UTF-8) or pipe in text, "
                            "not a binary file") from None


def read_message(stdin: TextIO, stdout: TextIO, interactive: bool) -> str | None:
    """One user message from `stdin`; None at the end of input.

    A message is one line, with two ways to write several: a line ending with a backslash goes on
    on the next line (the backslash becomes a line break), and a line starting with `BLOCK` opens a
    block that runs to the line ending with `BLOCK` (or to the end of input), line breaks kept --
    for pasting text. Interactive, each further line is prompted with `...> `."""

    def line(prompt: str) -> str | None:
        if interactive:
            stdout.write(prompt)
            stdout.flush()
        text = stdin.readline()
        return text.removesuffix("\n").removesuffix("\r") if text else None

    first = line("you> ")
    if first is None:
        return None
    if first.lstrip().startswith(BLOCK):
        rest, parts = first.lstrip()[len(BLOCK):], []
        while not rest.rstrip().endswith(BLOCK):
            if parts or rest.strip():
                parts.append(rest)
            rest = line("...> ")
            if rest is None:
                return "\n".join(parts)
        parts.append(rest.rstrip()[: -len(BLOCK)])
        return "\n".join(parts).strip("\n")
    parts = [first]
    while parts[-1].endswith("\\"):
        parts[-1] = parts[-1][:-1]
        more = line("...> ")
        if more is None:
            break
        parts.append(more)
    return "\n".join(parts)


RESET = "/reset"
"""What `chat_messages` yields for the /reset command."""


def chat_messages(stdin: TextIO, stdout: TextIO, interactive: bool) -> Iterator[str]:
    """The user's messages (`read_message`), and RESET (the very object) for /reset, up to /quit, /exit
    or the end of input; blank ones skipped."""
    while True:
        text = read_message(stdin, stdout, interactive)
        if text is None or text.strip() in ("/quit", "/exit"):
            return
        if text.strip() == "/reset":
            yield RESET
        elif text.strip():
            yield text


def chat(model_path: str, *, backend: str = "hf", max_new_tokens: int = 128, temperature: float = 0.7,
         greedy: bool = False, system: str | None = None, history: bool = True, raw: bool = False, seed: int = 0,
         tools: Sequence[str] = (), tool_parser: str = "hermes", max_tool_rounds: int | None = None,
         tool_timeout_s: float = 30.0, environment: str | None = None, environment_args: dict[str, Any] | None = None,
         max_turns: int | None = None, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, engine: Any = None) -> int:
    """Read user messages from `stdin` (`read_message`: one line, or several joined by trailing
    backslashes or inside a `BLOCK`), answer each with the model. `/reset` forgets the
    conversation, `/quit` (or end of input) leaves. Models with a chat template see the whole
    conversation through it; others (or with `raw`) see the latest message as a plain prompt.

    `tools` (`package.module:function` each, as `agent.tools`) reach the model through its chat
    template: a turn that calls them (`tool_parser`) is answered by running them (each within
    `tool_timeout_s`; a failed call is answered with its error, as in training), shown as `tool>`
    lines, and the model goes on from its own tokens, up to `max_tool_rounds` (4) times per message.

    `environment` (`package.module:Class`, as `agent.environment`, with `environment_args`): each
    message is a row an episode starts from instead (`{"prompt": message}`, or the row itself when
    the message is a JSON object), run to its end as in training (`AgentRunner`: up to `max_turns`
    (4) model turns, the tools, `tool_timeout_s` per environment step) and shown as its transcript
    and its outcome (`chat_episodes`).

    A message that does not fit the model's positions with `max_new_tokens` (`ContextWindow`) is
    refused: at a terminal with a message on stderr, and the chat goes on; piped input is a script,
    which ends there (DataError: exit 2), since what follows was written to follow that answer.
    `engine`: a rollout engine to answer with instead of loading one (tests)."""
    window = ContextWindow.of(model_path, "--model", say_unlimited=True)
    window.require_response_fits("--max-new-tokens", max_new_tokens)  # before the model loads
    if environment is not None:
        return chat_episodes(model_path, window, environment_agent(window, environment, environment_args, tools,
                                                                   tool_parser, tool_timeout_s, max_turns,
                                                                   max_new_tokens, system=system, history=history,
                                                                   max_tool_rounds=max_tool_rounds),
                             backend=backend, raw=raw, seed=seed, stdin=stdin, stdout=stdout, engine=engine,
                             params=SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens,
                                                   greedy=greedy))
    for flag, given in (("--max-turns", max_turns is not None), ("--environment-args", bool(environment_args))):
        if given:
            raise ConfigError(f"{flag}: for an episode with --environment; name the environment, or drop {flag}")
    max_tool_rounds = 4 if max_tool_rounds is None else max_tool_rounds
    box = ToolBox(load_tools(tools, "--tool")) if tools else None  # the user's code: before the model too
    parser = load_parser(tool_parser, "--tool-parser") if tools else None
    if engine is None:
        engine, tokenizer = load_generator(model_path, backend, max_model_len=4096, seed=seed)
    else:
        tokenizer = load_tokenizer(model_path)
    templated = tokenizer.chat_template is not None and not raw
    if box is not None and not templated:
        engine.close()
        raise ConfigError("--tool: tools reach the model through its chat template: "
                          + ("drop --raw" if raw else f"{model_path} has none; use a chat model"))
    caller = None if box is None else ToolCaller(box, parser, ChatRenderer(tokenizer, box.schemas), tool_timeout_s)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = stdin.isatty()
    turn = sent = 0
    try:
        for text in chat_messages(stdin, stdout, interactive):
            if text is RESET:
                messages = messages[:1] if system else []
                stdout.write("(conversation reset)\n")
                continue
            messages.append({"role": "user", "content": text})
            sent += 1
            if caller is not None:  # the template with the tools' schemas
                ids = caller.renderer.prompt(messages if history else messages[-1:])
            elif templated:
                text_in = tokenizer.apply_chat_template(messages if history else messages[-1:], tokenize=False,
                                                        add_generation_prompt=True)
                ids = tokenizer(text_in, add_special_tokens=False)["input_ids"]  # the template has the specials
            else:
                ids = encode_prompt(tokenizer, text)
            try:
                earlier = " with the conversation before it (/reset forgets it)" if templated and history and turn else ""
                window.require_prompt_fits(len(ids), "--max-new-tokens", max_new_tokens, f"message {sent}{earlier}")
            except DataError as e:
                if not interactive:
                    raise
                messages.pop()
                print(f"hpcrlhf: {e}; the message was not sent", file=sys.stderr, flush=True)
                continue
            params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens, greedy=greedy,
                                    seed=None if greedy else seed + turn)
            for rounds in range(max_tool_rounds + 1):
                gen = engine.generate([ids], params)[0][0]
                reply = tokenizer.decode(gen.response_ids, skip_special_tokens=True).strip()
                messages.append({"role": "assistant", "content": reply})
                answers = caller.answers(gen, rounds < max_tool_rounds) if caller is not None else []
                if not answers:
                    break
                for a in answers:
                    stdout.write(("tool> " if interactive else "tool: ") + f"{a.name}: {a.content}\n")
                messages += [a.message() for a in answers]
                ids = ids + list(gen.response_ids) + caller.renderer.observation([a.message() for a in answers])
                params = replace(params, seed=None if greedy else seed + turn + 1000 * (rounds + 1))
                try:
                    window.require_prompt_fits(len(ids), "--max-new-tokens", max_new_tokens,
                                               f"message {sent} with its tool answers")
                except DataError as e:
                    if not interactive:
                        raise
                    print(f"hpcrlhf: {e}; the model's answer stops here", file=sys.stderr, flush=True)
                    break
            stdout.write(("model> " if interactive else "") + reply + "\n")
            stdout.flush()
            turn += 1
        return 0
    finally:
        engine.close()
        if caller is not None:
            caller.close()


CHAT_POSITIONS = 4096
"""The positions `chat`'s engine holds (vLLM's max_model_len), when the model's own window is not smaller."""


@dataclass(frozen=True)
class ChatAgent:
    """`chat --environment`'s agent section, and the most tokens an episode's first render may take."""

    config: AgentConfig
    max_prompt_tokens: int


def environment_agent(window: ContextWindow, environment: str, environment_args: dict[str, Any] | None,
                      tools: Sequence[str], tool_parser: str, tool_timeout_s: float, max_turns: int | None,
                      max_new_tokens: int, *, system: str | None, history: bool,
                      max_tool_rounds: int | None) -> ChatAgent:
    """`chat --environment`'s agent section, and the longest first render of an episode: half the
    positions for it, half for the episode's turns (`agent.max_tokens`). A trajectory step that raises
    ends its episode (status env_error, shown) rather than the chat."""
    for flag, given in (("--system", system is not None), ("--no-history", not history),
                        ("--max-tool-rounds", max_tool_rounds is not None)):
        if given:
            raise ConfigError(f"{flag}: with --environment each message starts an episode of its own, whose "
                              f"environment gives its first messages and --max-turns its length; drop {flag}")
    positions = min(window.positions or CHAT_POSITIONS, CHAT_POSITIONS)
    if max_new_tokens > positions // 2:
        raise ConfigError(f"--max-new-tokens: {max_new_tokens} leaves no room for an episode's other turns in half of "
                          f"the {positions} positions (the other half is its first messages'); use at most "
                          f"{positions // 2}")
    args = dict(environment_args or {})
    # the user's code, checked under the chat's option names (the agent section would name its own fields)
    load_environment(environment, args, field="--environment", args_field="--environment-args")
    load_tools(tools, "--tool")
    load_parser(tool_parser, "--tool-parser")
    return ChatAgent(AgentConfig(environment=environment, environment_args=args, tools=tuple(tools),
                                 tool_parser=tool_parser, max_turns=4 if max_turns is None else max_turns,
                                 max_tokens=positions // 2, step_timeout_s=tool_timeout_s, env_workers=2,
                                 on_env_error="end", max_failed_share=1.0), positions - positions // 2)


def chat_episodes(model_path: str, window: ContextWindow, agent: ChatAgent, *, backend: str, raw: bool,
                  seed: int, params: SamplingParams, stdin: TextIO, stdout: TextIO, engine: Any = None) -> int:
    """`chat --environment`: each message (a JSON object: the row itself; else `{"prompt": message}`)
    starts an episode (its environment seeded by `seed` and the message's number), run to its end on
    the model and shown as its transcript -- `env`, `model` and `tool` lines -- and one line of its
    outcome. A row the environment refuses (its reset raises) is an error: at a terminal it is shown
    and the chat goes on; piped input ends there (exit 2)."""
    cfg, max_prompt = agent.config, agent.max_prompt_tokens
    tokenizer = load_tokenizer(model_path)
    templated = tokenizer.chat_template is not None and not raw
    runner = AgentRunner(cfg, tokenizer, chat=templated, max_prompt_tokens=max_prompt)  # the user's code: first
    interactive, sent = stdin.isatty(), 0
    mark = "> " if interactive else ": "
    try:
        if engine is None:
            engine, tokenizer = load_generator(model_path, backend, max_model_len=max_prompt + cfg.max_tokens,
                                               seed=seed, tokenizer=tokenizer)
        for text in chat_messages(stdin, stdout, interactive):
            if text is RESET:
                stdout.write("(each message starts an episode of its own)\n")
                continue
            sent += 1
            try:
                row = message_row(text, sent)
                gens, _ = runner.run(engine, [row], replace(params, seed=None if params.greedy else seed + sent),
                                     env_seed=mixed_seed(seed, sent), origins=[f"message {sent}"])
            except (AgentEnvError, DataError) as e:
                if not interactive:
                    raise
                print(f"hpcrlhf: {e}; no episode ran", file=sys.stderr, flush=True)
                continue
            gen = gens[0][0]
            for m in gen.episode.messages:
                who = {"user": "env", "assistant": "model"}.get(m["role"], m["role"])
                name = f"{m['name']}: " if m["role"] == "tool" and m.get("name") else ""
                stdout.write(f"{who}{mark}{name}{m['content']}\n")
            stdout.write(f"(episode: {episode_outcome(_trajectory(gen))})\n")
            stdout.flush()
        return 0
    finally:
        runner.close()
        if engine is not None:
            engine.close()


def message_row(text: str, number: int) -> dict[str, Any]:
    """The row chat message `number` starts an episode from: a JSON object as it is, else `{"prompt": text}`."""
    if not text.lstrip().startswith("{"):
        return {"prompt": text}
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"message {number}: it starts with '{{' but is no JSON object ({e.msg} at character "
                        f"{e.pos}); send a row as one JSON object, or a prompt that does not start with '{{'") from None
    if not isinstance(row, dict):
        raise DataError(f"message {number}: a row is a JSON object, got {type(row).__name__}")
    return row


def episode_outcome(line: dict[str, Any]) -> str:
    """One line of what an episode came to, from what `generate` writes of it (`_trajectory`)."""
    parts = [line["status"], f"{line['turns']} turn(s)", f"{line['tool_calls']} tool call(s)",
             f"reward {line['episode_reward']:g}"]
    parts += [] if "success" not in line else ["success" if line["success"] else "no success"]
    parts += [f"error: {line['error']}"] if "error" in line else []
    return ", ".join(parts)


class ToolCaller:
    """`chat`'s tools: a model turn's calls parsed, run (each within `timeout_s`) and answered."""

    def __init__(self, box: ToolBox, parser, renderer: ChatRenderer, timeout_s: float) -> None:
        self.box, self.parser, self.renderer, self.timeout_s = box, parser, renderer, timeout_s
        self.pool = EnvPool(1, name="hpcrlhf-chat-tools")

    def answers(self, gen, allowed: bool) -> list[ToolAnswer]:
        """The answers to the calls of model turn `gen` (none when it was cut at its length, made no
        call, or `allowed` is False: the message's rounds are used up)."""
        tokenizer = self.renderer.tokenizer
        calls = self.parser(tokenizer.decode(gen.response_ids, skip_special_tokens=False)) if gen.finished else []
        return [self._answer(c) for c in calls] if allowed else []

    def _answer(self, call) -> ToolAnswer:
        started = self.pool.call(self.box.answer, call, self.pool.run, timeout_s=self.timeout_s,
                                 label=f"tool {getattr(call, 'name', 'call')}")
        while not started.done():
            self.pool.wait([started], 0.1)
            if self.pool.overdue([started]):
                return ToolAnswer(getattr(call, "name", "invalid"), f"error: timeout: no answer within "
                                  f"{self.timeout_s:g} s (--tool-timeout)", "timeout")
        return started.future.result()

    def close(self) -> None:
        self.pool.close()
