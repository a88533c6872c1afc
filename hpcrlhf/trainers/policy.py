"""What DPO and KTO share: a policy trained against a frozen reference, and evaluation of the
policy's own preferences.

`PolicyTrainer.logps` returns a batch's response log-probs under the policy and the reference.
`policy_preferences` measures what the alignment is for, without the reference: on held-out
(prompt, correct, wrong) pairs, how often the policy gives the correct answer the higher
log-probability (overall and per difficulty tag), and the mean log-prob margin. Together with
the task score of greedy generations this shows whether training raised the model's preference
for correct answers.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hpcrlhf.data.preference import PairSample
from hpcrlhf.data.sft import TokenizedSample
from hpcrlhf.trainers.base import Trainer
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.reference import Reference
from hpcrlhf.trainers.sequences import response_logps


class PolicyTrainer(Trainer):
    """Each training/eval item holds SEQUENCES_PER_ITEM sequences (a pair's chosen and rejected
    response; a KTO sample and its mismatched sequence). Reference tables lay them out item by
    item, so sequence `part` of item i has id `SEQUENCES_PER_ITEM * i + part` (`sequence_ids`)."""

    SEQUENCES_PER_ITEM = 2

    def build_reference(self, sequences: Callable[[Any], tuple[TokenizedSample, ...]]) -> None:
        """Load the reference; with `reference.precompute`, score every sequence of `self.train`
        and `self.evals` (`sequences(item)` gives an item's) now and free the model."""
        ref = self.cfg.reference
        self.reference = Reference(self, ref.path or self.cfg.model.path, offload=ref.offload,
                                   key="reference.path" if ref.path else "model.path")
        if ref.precompute:
            tables = {name: [s for item in items for s in sequences(item)]
                      for name, items in (("train", self.train), ("eval", self.evals))}
            self.reference.precompute(tables, self.run.dir)

    def evaluated_models(self) -> dict[str, str]:
        ref = self.cfg.reference.path
        return {**super().evaluated_models(), **({"reference.path": ref} if ref else {})}

    def sequence_ids(self, indices: Sequence[int], part: int) -> list[int]:
        return [self.SEQUENCES_PER_ITEM * i + part for i in indices]

    def logps(self, samples: Sequence[TokenizedSample], table: str, ids: Sequence[int]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(policy summed log-probs, reference summed log-probs, response token counts)."""
        policy, counts = response_logps(self.engine, samples, self.pad_id, self.engine.device)
        ref, _ = self.reference.logps(samples, table, ids)
        return policy, ref, counts

    def policy_preferences(self, pairs: list[PairSample]) -> dict[str, float]:
        tags = sorted({p.tag for p in pairs if p.tag})

        def stats(batch: list[PairSample]) -> Stats:
            logps, _ = response_logps(self.engine, [p.chosen for p in batch] + [p.rejected for p in batch],
                                      self.pad_id, self.engine.device)
            margin = (logps[: len(batch)] - logps[len(batch) :]).tolist()
            out = {"eval/pref_accuracy": (sum(m > 0 for m in margin), len(batch)),
                   "eval/logp_margin": (sum(margin), len(batch))}
            for tag in tags:
                out[f"eval/pref_accuracy_{tag}"] = (sum(m > 0 for m, p in zip(margin, batch) if p.tag == tag),
                                                    sum(p.tag == tag for p in batch))
            return out

        self.engine.eval()
        return self.eval_means(pairs, stats) if pairs else {}


def task_pairs(trainer: Trainer) -> list[PairSample]:
    """Held-out (prompt, correct, wrong) pairs from the bundled task (none without a task)."""
    from hpcrlhf.config.schema import PairDataConfig
    from hpcrlhf.data.preference import tokenize_pairs
    from hpcrlhf.data.sft import keep_usable
    from hpcrlhf.data.sources import rows_from_records
    from hpcrlhf.data.tasks import build_task

    task, cfg = build_task(trainer.cfg.task, trainer.cfg.data), trainer.cfg
    if task is None:
        return []
    rows = rows_from_records(task.mixed_preference_rows("eval", cfg.task.eval_size, cfg.task.hard_pair_fraction,
                                                         cfg.task.near_miss),
                             f"task:{task.name}[eval]")
    data = PairDataConfig(max_length=cfg.data.max_length, apply_chat_template=cfg.data.apply_chat_template)
    return keep_usable(*tokenize_pairs(rows, trainer.tokenizer, data), split="eval", path=None)
