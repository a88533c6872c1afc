"""`hpcrlhf eval`: models answer benchmark prompts, scored as in-run evaluation scores them.

Targets are a model folder (`--model`), or models of a run (`--run` with `checkpoints`: its
checkpoints, `best/`, `model/`). A checkpoint becomes a Hugging Face folder first (`materialize`:
the DeepSpeed model states -- ZeRO-3's partitions joined -- written as training's export writes
them, LoRA adapters merged). Each target answers each dataset (`datasets`, or the held-out
prompts) greedily or with `eval.samples_per_prompt` seeded samples, the same draws for every target;
the task score and the metrics give mean@n, pass@k and maj@n (`hpcrlhf.rewards.sampled`).

The work is cut into batches of `eval.batch_size` prompts; with several ranks (torchrun, srun) rank r
answers batches r, r + world, .... Each batch, once scored, is one JSON line in
`OUT/samples/<target>/<dataset>.rank<r>.jsonl` (its answers, their values, and the sums the results
are made of), so an interrupted evaluation (a stop signal: exit 3; a crash) resumes at the first
batch not written. Rank 0 then writes `results.json`, `results.md` (a table per dataset) and
`results.png` (each metric across the targets).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from functools import partial
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import torch
import yaml

from hpcrlhf.config.loader import to_yaml
from hpcrlhf.config.schema import DataSourceConfig, EvalJobConfig
from hpcrlhf.data.loading import held_out_prompt_rows, require_task_prompts
from hpcrlhf.data.prompts import Prompt, encode_prompt_rows
from hpcrlhf.data.sources import read_rows, require_text
from hpcrlhf.data.tasks import build_task
from hpcrlhf.engines.distributed import all_reduce_sum, barrier, init_distributed, on_main_rank, read_dist_env
from hpcrlhf.errors import ConfigError, DataError, HpcrlhfError, Hung
from hpcrlhf.inference import load_generator
from hpcrlhf.logs import THIRD_PARTY_LOG, Progress, get_logger, third_party_to
from hpcrlhf.models.context import ContextWindow
from hpcrlhf.models.export import export_pretrained
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
from hpcrlhf.plots import figure
from hpcrlhf.rewards.rules import EvalMetrics, check_rules
from hpcrlhf.rewards.sampled import Sampling, sampling_for
from hpcrlhf.run.checkpoint import CheckpointDir, verify_checkpoint
from hpcrlhf.run.diskspace import out_of_space_is_an_error
from hpcrlhf.run.files import append, ensure_folder, make_folders, replace_file
from hpcrlhf.run.folder import config_changes
from hpcrlhf.run.metrics import read_json_lines
from hpcrlhf.run.lock import RunLock
from hpcrlhf.run.stats import add_stats, new_stats
from hpcrlhf.run.signals import StopFlag, StopRequested, active_watchdog
from hpcrlhf.run.watchdog import Watchdog, WaitExpired, watched
from hpcrlhf.trainers.loop import eval_sampling_params
from hpcrlhf.trainers.online import flatten_generations

log = get_logger()

RERUN_SAFE = ("checkpoints", "keep_models", "output_dir", "rollout.vllm_", "watchdog.")
"""Settings a rerun on an output folder may change: which targets, what is kept, the vLLM engine's memory, deadlines.
Anything else would mix answers drawn differently into one result."""


@dataclass(frozen=True)
class EvalTarget:
    name: str
    """How results name it: `step_000100`, `best`, `model`, or the model folder's name."""
    step: int | None
    """The training step of a run's model (None for a model folder)."""
    path: str
    """A Hugging Face folder (or hub name), or a checkpoint folder (`checkpoint`)."""
    checkpoint: bool = False


@dataclass
class EvalSet:
    """A dataset, read and tokenised once: what every target answers and how answers are scored."""

    name: str
    source: str
    prompts: list[Prompt]
    metrics: EvalMetrics
    sampling: Sampling | None
    """How several samples per prompt are judged (None: one answer each)."""


# -- settings and targets ------------------------------------------------------------------------

def _step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step_"))


def resolve_targets(cfg: EvalJobConfig) -> list[EvalTarget]:
    """The models `cfg` evaluates, in order, each checked to be there (a missing one names what is)."""
    if cfg.run is None:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(cfg.model.path.rstrip("/")).name) or "model"
        return [EvalTarget(name, None, cfg.model.path)]
    run = Path(cfg.run)
    ckpts = CheckpointDir(run / "checkpoints")
    complete = {_step_of(p): p for p in ckpts.complete()}

    def there() -> str:
        models = [name + "/" for name in ("best", "model") if (run / name / "config.json").is_file()]
        steps = ", ".join(map(str, complete)) or "none"
        return f"checkpoints at steps {steps}" + (f"; {' and '.join(models)}" if models else "")

    targets: list[EvalTarget] = []
    for part in cfg.checkpoints.split(","):
        if part == "latest":
            folder = ckpts.latest_intact()
            if folder is None:
                raise ConfigError(f"checkpoints: latest, but {run}/checkpoints holds no intact checkpoint ({there()}): "
                                  "name the run's model with --checkpoints model, or a step")
            targets.append(EvalTarget(folder.name, _step_of(folder), str(folder), True))
        elif part == "all":
            for step, folder in complete.items():
                problems = verify_checkpoint(folder)
                if problems:
                    log.warning(f"checkpoint {folder} is damaged ({problems[0]}): not evaluated")
                    continue
                targets.append(EvalTarget(folder.name, step, str(folder), True))
            if not complete:
                raise ConfigError(f"checkpoints: all, but {run}/checkpoints holds none ({there()}): "
                                  "name the run's model with --checkpoints model")
        elif part in ("best", "model"):
            folder = run / part
            if not (folder / "config.json").is_file():
                raise ConfigError(f"checkpoints: {part}, but {run} has no {part}/ ({there()})"
                                  + (": it is written by eval.keep_best" if part == "best" else
                                     ": it is written at the end of training"))
            architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
            if any(a.endswith("ForSequenceClassification") for a in architectures):
                raise ConfigError(f"--run {run}: {part}/ is a reward model ({architectures[0]}): hpcrlhf eval scores "
                                  "generated answers; a reward model's accuracy is its run's eval/accuracy")
            record = folder / "best.json" if part == "best" else run / "summary.json"
            step = json.loads(record.read_text()).get("step") if record.is_file() else None
            targets.append(EvalTarget(part, step, str(folder)))
        else:
            step = int(part)
            if step not in complete:
                raise ConfigError(f"checkpoints: {cfg.checkpoints}: {run} has no checkpoint at step {step} ({there()})")
            problems = verify_checkpoint(complete[step])
            if problems:
                raise DataError(f"checkpoint {complete[step]} is damaged ({'; '.join(problems[:3])}): it cannot be "
                                "evaluated; name another step")
            targets.append(EvalTarget(complete[step].name, step, str(complete[step]), True))
    if not targets:
        raise DataError(f"checkpoints: {cfg.checkpoints}: every checkpoint of {run} is damaged (see the warnings): "
                        "name the run's model with --checkpoints model")
    seen: set[str] = set()
    return [t for t in targets if not (t.name in seen or seen.add(t.name))]


# -- a checkpoint as a model folder --------------------------------------------------------------

def checkpoint_state(folder: Path) -> dict[str, torch.Tensor]:
    """The trained model's weights in a checkpoint folder (a PPO step's: the actor's, at its root):
    DeepSpeed's model states at ZeRO 0-2, the fp32 partitions joined at ZeRO-3."""
    whole = folder / "mp_rank_00_model_states.pt"
    if whole.is_file():
        return torch.load(whole, map_location="cpu", weights_only=False)["module"]
    if any(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    raise DataError(f"{folder}: no DeepSpeed model states there (mp_rank_00_model_states.pt, or ZeRO-3's "
                    "zero_pp_rank_*_mp_rank_00_model_states.pt): not a checkpoint hpcrlhf wrote, or damaged")


def materialize(target: EvalTarget, cfg: EvalJobConfig, out: Path, tokenizer) -> str:
    """`target` as a Hugging Face folder: itself, or its checkpoint exported into OUT/models/<name>/."""
    if not target.checkpoint:
        return target.path
    state = checkpoint_state(Path(target.path))
    if any(k.startswith("hf_model.") for k in state):
        raise ConfigError(f"--run {cfg.run}: {target.path} holds a reward model (a value head): hpcrlhf eval scores "
                          "generated answers; a reward model's accuracy is its run's eval/accuracy")
    m = cfg.model

    def build_base() -> torch.nn.Module:
        return load_causal_lm(m.path, attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code)

    folder = out / "models" / target.name
    # with LoRA the model is rebuilt by merge_adapters from build_base; a plain module says it has no value head
    module = torch.nn.Module() if cfg.lora.rank else build_base()
    # adapters merge into the full-precision base (QLoRA's 4-bit base is how training saved memory)
    lora = replace(cfg.lora, load_in_4bit=False)
    export_pretrained(module, state, folder, tokenizer, lora=lora, build_base=build_base)
    return str(folder)


# -- datasets ----------------------------------------------------------------------------------

def load_sets(cfg: EvalJobConfig, tokenizer, window: ContextWindow) -> list[EvalSet]:
    """Every dataset, read, checked and tokenised before any model loads."""
    sets = []
    for i, d in enumerate(cfg.sets):
        key = d.prompt_key or cfg.data.prompt_key
        if d.path is None:
            data: DataSourceConfig = cfg.data
            rows, key = held_out_prompt_rows(data, cfg.task, d.max_samples or cfg.eval.score_prompts)
            source = data.eval_path or f"the {cfg.task.resolve(data)} task's held-out prompts"
            if not rows:
                raise ConfigError("datasets: none given, and there are no held-out prompts (no data.eval_path, no "
                                  "bundled task): name a file, e.g. --set 'datasets=[{path: test.jsonl}]'")
        else:
            data = replace(cfg.data, train_path=d.path, eval_path=None, prompt_key=key)
            rows = read_rows(d.path, split=cfg.data.split, limit=d.max_samples)
            require_text(rows, (key,), key_option={key: f"datasets[{i}].prompt_key"})
            require_task_prompts(rows, key, cfg.task, data)
            source = d.path
        task = build_task(cfg.task, data)
        metrics_names = cfg.eval.metrics if d.metrics is None else d.metrics
        field = "eval.metrics" if d.metrics is None else f"datasets[{i}].metrics"
        metrics = EvalMetrics(metrics_names, task, field, cfg.eval.metric_timeout_s, rules=cfg.rules)
        if not metrics.rules:
            raise ConfigError(f"datasets[{i}] ({d.label}): nothing scores its answers (no task applies to {source}): "
                              f"name metrics, e.g. --set eval.metrics=[math] or datasets[{i}].metrics")
        prompts = encode_prompt_rows(rows, replace(cfg.data, prompt_key=key), tokenizer, key)
        window.require_prompts_fit(((len(p.ids), p.origin) for p in prompts), "eval.max_new_tokens",
                                   cfg.eval.max_new_tokens)
        sampling = sampling_for(replace(cfg.eval, metrics=tuple(metrics_names)), cfg.rules, task)
        sets.append(EvalSet(d.label, source, prompts, metrics, sampling))
    return sets


# -- the job -----------------------------------------------------------------------------------

def _prepare_folder(out: Path, cfg: EvalJobConfig) -> RunLock:
    """Rank 0: the output folder made, locked and checked (`_check_rerun`); the lock is released on a refusal."""
    make_folders(out, "--output-dir")
    lock = RunLock(ensure_folder(out)).acquire()
    try:
        _check_rerun(out, cfg)
    except HpcrlhfError:
        lock.release()
        raise
    return lock


def _check_rerun(out: Path, cfg: EvalJobConfig) -> None:
    """An output folder holds one evaluation's answers: a rerun with other settings is refused (naming them).
    The run folder is compared as an absolute path (`hpcrlhf sbatch` makes it one; a rerun by hand may not)."""
    if cfg.run:
        cfg = replace(cfg, run=str(Path(cfg.run).resolve()))
    path = out / "eval.yaml"
    now = yaml.safe_load(to_yaml(cfg))
    if path.is_file() and (out / "samples").is_dir():
        changes = {k: v for k, v in config_changes(yaml.safe_load(path.read_text()) or {}, now).items()
                   if not k.startswith(RERUN_SAFE)}
        if changes:
            shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in list(changes.items())[:5]))
            raise ConfigError(f"--output-dir {out} holds answers drawn with other settings ({shown}): use another "
                              f"--output-dir, or delete {out}/samples to answer again")
    replace_file(path, to_yaml(cfg))


def _samples_file(out: Path, target: EvalTarget, s: EvalSet, rank: int) -> Path:
    return out / "samples" / target.name / f"{s.name}.rank{rank}.jsonl"


def read_batches(path: Path) -> dict[int, dict[str, Any]]:
    """The batches a samples file holds, by index (a torn last line, from a crash mid-write, is dropped)."""
    if not path.is_file():
        return {}
    records = read_json_lines(path, torn="that batch runs again", fix="delete the file to answer its batches again")
    return {record["batch"]: record for record in records}


def _batch_record(b: int, start: int, batch: list[Prompt], gens, tokenizer, s: EvalSet) -> dict[str, Any]:
    _, flat, responses = flatten_generations(batch, gens, tokenizer)
    values = s.metrics.values(responses)
    stats = s.metrics.summed(values, [r.text for r in responses], "", s.sampling)
    n = len(gens[0]) if gens else 1
    prompts = [{"index": start + i, "origin": p.origin, "prompt": p.text,
                "responses": [r.text for r in responses[i * n:(i + 1) * n]],
                "finished": [g.finished for g in flat[i * n:(i + 1) * n]],
                "values": {name: v[i * n:(i + 1) * n] for name, v in values.items()}}
               for i, p in enumerate(batch)]
    return {"batch": b, "stats": {k: list(v) for k, v in stats.items()}, "prompts": prompts}


def run_eval(cfg: EvalJobConfig) -> dict[str, Any]:
    """Evaluate every target on every dataset; returns the results (also in OUT/results.json).
    {"status": "stopped"} when a stop signal ended it between batches (rerun to resume)."""
    out = Path(cfg.out_dir)
    env = read_dist_env()
    check_rules(cfg)  # the user's code is imported before anything loads
    targets = resolve_targets(cfg)
    tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    window = ContextWindow.of(cfg.model.path)
    sets = load_sets(cfg, tokenizer, window)
    if cfg.rollout.backend == "vllm" and env.world_size > 1:
        raise ConfigError(f"rollout.backend: vllm with {env.world_size} ranks: one vLLM engine evaluates for the "
                          "whole job (its own batching fills the GPU); launch one process, or use rollout.backend=hf")
    flag = StopFlag().install()
    if env.world_size > 1:
        init_distributed()
    lock = on_main_rank(lambda: _prepare_folder(out, cfg), env.rank == 0, share=False)  # a refusal ends every rank
    third_party_to("file", out / THIRD_PARTY_LOG)
    dog = Watchdog.of_rank(cfg.watchdog, out / "watchdog", env.rank, env.world_size)
    try:
        try:
            stopped = _answer_all(cfg, out, env, targets, sets, tokenizer, flag)
        except WaitExpired as e:
            raise Hung(f"{e.expiry.message()}; the answers written so far are kept in {out}/samples: rerun the same "
                       "command to go on from there") from None
        barrier()
        if stopped:
            log.info(f"hpcrlhf eval stopped on a signal; the answers so far are in {out}/samples: rerun the same "
                     "command to go on (exit 3)")
            return {"status": "stopped"}
        if env.rank != 0:
            return {}
        return write_results(cfg, out, targets, sets, env.world_size)
    finally:
        if dog is not None:
            dog.stop(until_exit=True)  # a hung evaluation's teardown stays under the grace exit
        if lock is not None:
            lock.release()


class TargetEngine:
    """The engine each target answers with. HF loads each model in turn; vLLM starts one engine, for the
    first target, and is given each later target's weights (a run's models share one architecture): one
    engine start for a whole comparison."""

    def __init__(self, cfg: EvalJobConfig, tokenizer, local_rank: int):
        self.cfg, self.tokenizer, self.local_rank = cfg, tokenizer, local_rank
        self.engine = None

    def load(self, path: str):
        if self.engine is not None and self.cfg.rollout.backend == "vllm":
            self.engine.load_weights(folder_weights(Path(path)))
            return self.engine
        self.close()
        cfg = self.cfg
        self.engine, _ = load_generator(path, cfg.rollout.backend, max_model_len=cfg.data.max_length + cfg.eval.max_new_tokens,
                                        rollout=cfg.rollout, seed=cfg.seed, tokenizer=self.tokenizer,
                                        trust_remote_code=cfg.model.trust_remote_code,
                                        attn_implementation=cfg.model.attn_implementation, local_rank=self.local_rank)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def folder_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a Hugging Face folder's safetensors files (checkpoint names), one at a time."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DataError(f"{folder}: no *.safetensors files: hpcrlhf eval gives a running vLLM engine a model's weights "
                        "from them (a folder saved with safe_serialization)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _answer_all(cfg, out: Path, env, targets, sets, tokenizer, flag: StopFlag) -> bool:
    """Answer every (target, dataset) batch this rank owns and has not written yet; True when stopped."""
    bs = cfg.eval.batch_size
    todo = []
    for target in targets:
        units = []
        for s in sets:
            done = read_batches(_samples_file(out, target, s, env.rank))
            count = math.ceil(len(s.prompts) / bs)
            units.append((s, [b for b in range(count) if b % env.world_size == env.rank and b not in done]))
        todo.append((target, units))
    total = sum(len(s.prompts) for s in sets) * len(targets)
    left = sum(min(bs, len(s.prompts) - b * bs) for _, units in todo for s, batches in units for b in batches)
    progress = Progress(total, initial=total - left, desc="eval", enabled=env.rank == 0)
    engines = TargetEngine(cfg, tokenizer, env.local_rank)
    try:
        for target, units in todo:
            # every rank takes part in every target (the materialized folder, the stop checks), work or not
            if not all_reduce_sum([float(any(batches for _, batches in units))])[0]:
                continue  # answered by every rank already
            # a damaged checkpoint, a full disk: an error on every rank, none left waiting
            path = on_main_rank(partial(materialize, target, cfg, out, tokenizer), env.rank == 0)
            log.info(f"evaluating {target.name} ({path})")
            with watched(active_watchdog(), "load", per_step=False):  # a target's model
                engine = engines.load(path)
            if _answer_target(cfg, out, env, target, units, engine, tokenizer, flag, progress):
                return True
            barrier()
            if target.checkpoint and env.rank == 0 and not cfg.keep_models:
                shutil.rmtree(out / "models" / target.name, ignore_errors=True)
    finally:
        engines.close()
        progress.close()
    return bool(all_reduce_sum([float(flag.requested)])[0])


def _answer_target(cfg, out: Path, env, target: EvalTarget, units, engine, tokenizer, flag: StopFlag,
                   progress: Progress) -> bool:
    """One target's batches of each dataset (this rank's, not yet written); True when stopped."""
    bs = cfg.eval.batch_size
    params = eval_sampling_params(cfg.eval, cfg.seed, cfg.eval.max_new_tokens)
    for s, batches in units:
        rounds = math.ceil(math.ceil(len(s.prompts) / bs) / env.world_size)
        mine = iter(batches)
        for _ in range(rounds):  # the same count on every rank: each round agrees on stopping
            with watched(active_watchdog(), "batch", per_step=False):  # answers and scores (a rank waiting for a hung peer too)
                if all_reduce_sum([float(flag.requested)])[0]:
                    return True
                b = next(mine, None)
                if b is None:
                    continue
                batch = s.prompts[b * bs:(b + 1) * bs]
                gens = engine.generate([list(p.ids) for p in batch], replace(params, first_index=b * bs))
                if flag.requested:  # a generation cut short by the signal: not kept
                    continue
                try:
                    record = _batch_record(b, b * bs, batch, gens, tokenizer, s)
                except StopRequested:  # the signal came while a metric ran: the batch is not kept, the next round stops
                    continue
            samples = _samples_file(out, target, s, env.rank)
            ensure_folder(samples.parent.parent)
            ensure_folder(samples.parent)
            with out_of_space_is_an_error(out, "the evaluation's answers"):
                append(samples, (json.dumps(record) + "\n").encode())
            progress.update(len(batch))
    return False


# -- results -----------------------------------------------------------------------------------

def unit_means(out: Path, target: EvalTarget, s: EvalSet, world_size: int, batch_size: int) -> dict[str, float]:
    """The means of a (target, dataset) over every batch of every rank's samples file."""
    batches: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        batches.update(read_batches(_samples_file(out, target, s, rank)))
    expected = math.ceil(len(s.prompts) / batch_size)
    missing = sorted(set(range(expected)) - set(batches))
    if missing:
        raise DataError(f"{out}/samples/{target.name}/{s.name}.rank*.jsonl lack batches {missing[:5]} of {expected} "
                        "(written by another world size or batch size?): rerun with the same ones, or delete them")
    sums = new_stats()
    for b in range(expected):
        add_stats(sums, batches[b]["stats"])
    return {k: total / count for k, (total, count) in sorted(sums.items()) if count > 0}


def write_results(cfg: EvalJobConfig, out: Path, targets: list[EvalTarget], sets: list[EvalSet],
                  world_size: int) -> dict[str, Any]:
    """results.json, results.md and results.png from the samples files; the table is also logged."""
    table = {t.name: {s.name: unit_means(out, t, s, world_size, cfg.eval.batch_size) for s in sets} for t in targets}
    e = cfg.eval
    results = {
        "targets": [{"name": t.name, "step": t.step, "path": t.path} for t in targets],
        "datasets": [{"name": s.name, "source": s.source, "prompts": len(s.prompts)} for s in sets],
        "sampling": {"samples_per_prompt": e.samples_per_prompt, "greedy": not e.sampled,
                     "temperature": (e.temperature or 1.0) if e.sampled else None, "top_p": e.top_p,
                     "pass_k": list(e.ks), "pass_threshold": e.pass_threshold, "seed": cfg.seed,
                     "max_new_tokens": e.max_new_tokens, "backend": cfg.rollout.backend},
        "results": table,
    }
    replace_file(out / "results.json", json.dumps(results, indent=2) + "\n")
    markdown = results_table(results)
    replace_file(out / "results.md", markdown)
    plot_results(results, out / "results.png")
    log.info("hpcrlhf eval results (also in " + str(out / "results.md") + "):\n" + markdown)
    return results


def _columns(results: dict[str, Any], dataset: str) -> list[str]:
    """A dataset's metric keys, each metric's mean@n first, then its pass@k by k, then maj@n."""
    keys = {k for per_set in results["results"].values() for k in per_set[dataset]}

    def order(key: str) -> tuple:
        base, _, figure = key.partition("/pass@") if "/pass@" in key else key.partition("/maj@")
        kind = 0 if not figure else 1 if "/pass@" in key else 2
        return base, kind, int(figure) if figure.isdigit() else 0

    return sorted(keys, key=order)


def results_table(results: dict[str, Any]) -> str:
    """A markdown table per dataset: a row per target, a column per metric (mean@n, pass@k, maj@n)."""
    s = results["sampling"]
    how = "greedy" if s["greedy"] else f"{s['samples_per_prompt']} samples per prompt at temperature {s['temperature']:g}"
    lines = [f"# hpcrlhf eval ({how}, seed {s['seed']})", ""]
    for d in results["datasets"]:
        keys = _columns(results, d["name"])
        lines += [f"## {d['name']} ({d['prompts']} prompts: {d['source']})", "",
                  "| model | step | " + " | ".join(k.removeprefix("eval/") for k in keys) + " |",
                  "| --- | --- |" + " --- |" * len(keys)]
        for t in results["targets"]:
            row = results["results"][t["name"]][d["name"]]
            cells = [f"{row[k]:.4f}" if k in row else "" for k in keys]
            lines.append(f"| {t['name']} | {'' if t['step'] is None else t['step']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def x_axis(targets: list[dict[str, Any]]) -> tuple[list[float], str | None]:
    """Where each target goes on the plots' x axis, and its label: the training step when every target has
    one (a run's checkpoints: spaced as trained), else its position (models of no run: named on the axis)."""
    steps = [t["step"] for t in targets]
    if steps and all(isinstance(s, int) for s in steps) and len(set(steps)) == len(steps):
        return [float(s) for s in steps], "step"
    return [float(i) for i in range(len(targets))], None


def plot_results(results: dict[str, Any], path: Path) -> Path:
    """A panel per (dataset, metric): each target's value against its step (a run's checkpoints), or in the
    order evaluated, named (other models)."""
    panels = [(d["name"], k) for d in results["datasets"] for k in _columns(results, d["name"])]
    order = sorted(range(len(results["targets"])), key=lambda i: x_axis(results["targets"])[0][i])
    targets = [results["targets"][i] for i in order]
    xs, label = x_axis(targets)
    names = [t["name"] for t in targets]
    with figure(path, ncols=max(1, len(panels)), figsize=(3.6 * max(1, len(panels)), 3.2)) as (_, axes):
        for ax, (dataset, key) in zip(axes, panels):
            values = [results["results"][n][dataset].get(key, float("nan")) for n in names]
            ax.plot(xs, values, marker="o")
            if label is None:
                ax.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
            else:
                ax.set_xlabel(label)
            ax.set_title(f"{dataset}: {key.removeprefix('eval/')}", fontsize=9)
            ax.grid(alpha=0.3)
    return path
