"""The base of the jobs that train one model (SFT, RM, DPO, KTO, CSFT, rejection sampling), on top
of the shared loop (`loop.TrainingLoop`).

A subclass calls `setup(cfg)`, loads its data, calls `build_engine(num_rows)` and supplies
`train_step(step)` and `evaluate()`. This base holds the trained model -- causal LM or value model,
LoRA, under DeepSpeed -- and answers the loop's questions about it (checkpoint, weights, optimizer
statistics, skipped updates, the exported model). `sample_mean_step` is the shared shape of a step
whose loss is a mean over samples; `generation_scores` answers the held-out prompts greedily and
reports the task score and the user's `eval.metrics` of the answers.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Sequence

import torch

from hpcrlhf.data.sft import encode_prompts
from hpcrlhf.data.sources import Row
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.engines.hf_generate import generate_greedy
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.logs import get_logger
from hpcrlhf.models.factory import trainable_parameters
from hpcrlhf.rewards.response import Response
from hpcrlhf.run.stats import Stats, add_stats, new_stats, reduce_means
from hpcrlhf.trainers.batches import BatchPlan, key_settings
from hpcrlhf.trainers.loop import Checkpointable, TrainingLoop

log = get_logger()


class SingleModelTrainer(TrainingLoop):
    """A job that trains one model (`self.engine`) on a `BatchPlan`."""

    plan: BatchPlan

    # -- construction ---------------------------------------------------------------------------
    def build_engine(self, num_rows: int) -> None:
        """The batch plan and the trained model under DeepSpeed (with LoRA when configured)."""
        cfg = self.cfg
        self.plan = BatchPlan.build(cfg.train, num_rows=num_rows, data_parallel_size=self.env.world_size)
        self.engine = self.models.build_trained_model(cfg.model.path, value_head=self.value_head, optim=cfg.optim,
                                                      micro_batch_rows=self.plan.micro_batch_rows,
                                                      grad_accum_steps=self.plan.grad_accum_steps,
                                                      total_steps=self.plan.total_steps)
        log.info(f"{self.kind}: {num_rows} training rows, {self.plan.total_steps} steps, {self.env.world_size} rank(s) x "
                 f"{self.plan.micro_batch_rows} rows x {self.plan.grad_accum_steps} accumulation, ZeRO-{cfg.engine.zero_stage}, "
                 f"{cfg.engine.precision} on {self.device}"
                 + (f", LoRA rank {cfg.lora.rank} ({trainable_parameters(self.engine)} trainable parameters)"
                    if cfg.lora.rank else ""))
        log.info(key_settings(cfg, ranks=self.env.world_size, micro_batch_rows=self.plan.micro_batch_rows,
                              grad_accum_steps=self.plan.grad_accum_steps))

    # -- the loop's questions about the trained model ------------------------------------------
    def trained_weights(self):
        """The trained model's (name, tensor) pairs, None when this process does not hold them whole
        (ZeRO-3 shards)."""
        return None if self.engine.zero_stage == 3 else self.engine.module.named_parameters()

    @property
    def checkpointable(self) -> Checkpointable:
        return self.engine

    def skipped_updates(self) -> int | None:
        return self.engine.skipped_updates

    def optimizer_stats(self) -> dict[str, float | None]:
        return self.engine.optimizer_stats()

    # -- the exported model ----------------------------------------------------------------------
    def exported_config(self) -> dict[str, Any]:
        """Extra entries for the exported model's config.json."""
        return {}

    def exported_files(self) -> dict[str, str]:
        """Extra files (name -> text) exported with the model, in `model/`."""
        return {}

    def save_outputs(self, folder: str = "model", files: dict[str, str] | None = None) -> None:
        """Write the model in Hugging Face format into `folder` of the run folder (LoRA adapters
        merged, the adapter alone in `adapter/` there), with `files` beside it."""
        extra = self.exported_config()  # may need every rank (collectives)
        self.models.export(self.engine, value_head=self.value_head, config_updates=extra,
                           files={**self.exported_files(), **(files or {})}, folder=folder)

    # -- shared shapes of a step and of an evaluation ------------------------------------------
    def sample_mean_step(self, step: int, num_rows: int,
                         micro_loss: Callable[[list[int]], tuple[torch.Tensor, int, Stats]],
                         indices: list[int] | None = None) -> dict[str, float]:
        """One optimizer step on a loss that is a mean over the samples of the global batch.

        `micro_loss(indices)` returns the mean loss over those samples, their token count and
        statistics. Each micro-batch's mean is weighted by its share of the global batch (every
        rank gets the same number of rows), so 1 rank and N ranks compute the same update.
        `indices` overrides the plan's choice of this rank's rows.
        """
        if indices is None:
            indices = self.plan.rows_for_step(num_rows, step, self.cfg.seed, self.env.rank)
        global_rows, world = self.plan.global_batch_rows, self.env.world_size
        self.engine.train()
        sums = new_stats()
        tokens = 0
        for start in range(0, len(indices), self.plan.micro_batch_rows):
            part = indices[start : start + self.plan.micro_batch_rows]
            loss, n_tokens, stats = micro_loss(part)
            self.engine.backward(loss * (len(part) * world / global_rows))
            self.engine.step()
            tokens += n_tokens
            add_stats(sums, {"train/loss": (float(loss.detach()) * len(part), len(part)), **stats})
        means = reduce_means(sums)
        means["train/tokens"] = all_reduce_sum([tokens])[0]
        means["train/samples"] = float(global_rows)
        return means

    def score_prompts(self, template: Callable[[str], str] = str) -> list[tuple[list[int], Row]]:
        """(token ids of template(prompt), row) for the held-out prompts evaluation answers."""
        rows, key = self.held_out
        ids = encode_prompts(self.tokenizer, [template(r.data[key]) for r in rows], self.cfg.data.apply_chat_template)
        self.window.require_prompts_fit(((len(p), r.origin) for p, r in zip(ids, rows)), "eval.max_new_tokens",
                                        self.cfg.eval.max_new_tokens)
        return list(zip(ids, rows))

    def generation_scores(self, prompts: Sequence[tuple[list[int], Row]], suffix: str = "") -> dict[str, float]:
        """Means of the task score and `eval.metrics` of greedy answers to (prompt ids, row) pairs --
        or of `eval.samples_per_prompt` sampled ones, with pass@k and maj@n -- as `eval/<name><suffix>`
        (nothing to generate when there are neither)."""
        key = self.held_out[1]
        synced = self.engine.zero_stage == 3 and self.env.world_size > 1
        params = self.eval_params(self.cfg.eval.max_new_tokens)

        def stats(batch: list) -> Stats:
            with self.run.stoppable():
                ids = [ids for ids, _ in batch]
                if params.greedy:
                    texts = generate_greedy(self.engine.module, self.tokenizer, ids, max_new_tokens=params.max_new_tokens,
                                            device=self.engine.device, synced_gpus=synced)
                else:
                    sampler = HFRollout(self.engine.module, pad_token_id=self.models.pad_id,
                                        eos_token_id=self.tokenizer.eos_token_id, device=self.engine.device,
                                        synced_gpus=synced)
                    texts = self.tokenizer.batch_decode([g.response_ids for gens in sampler.generate(ids, params)
                                                         for g in gens], skip_special_tokens=True)
                rows = [row for _, row in batch for _ in range(params.n)]
                return self.metrics.stats([Response(row.data[key], text, (), row.data, row.origin)
                                           for row, text in zip(rows, texts)], suffix, self.eval_sampling)

        self.engine.eval()
        return self.eval_means(prompts, stats) if prompts and self.metrics.rules else {}
