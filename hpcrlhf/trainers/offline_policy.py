"""What DPO and KTO share: a policy trained on fixed data against a frozen reference, the
reference's log-probs, and evaluation of the policy's own preferences.

`OfflinePolicyTrainer.logps` returns a batch's response log-probs under the policy and the
reference. `policy_preferences` measures what the alignment is for, without the reference: on
held-out (prompt, correct, wrong) pairs, how often the policy gives the correct answer the higher
log-probability (overall and per difficulty tag), and the mean log-prob margin. Together with
the task score of greedy generations this shows whether training raised the model's preference
for correct answers.

`Reference` gives the reference's log-probs from a live forward pass, or from tables computed
once before training (`reference.precompute`): every sequence a trainer will ask about is scored
up front (sharded over ranks, summed back), the tables are cached in the run folder (a resumed run
reuses them when the sequences and reference are the same) and the model is freed. Tables are
addressed by name ("train", "eval") and a sequence index fixed by the trainer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import torch

from hpcrlhf.config.schema import DPOConfig, KTOConfig, PairDataConfig
from hpcrlhf.data.preference import PairSample, tokenize_pairs
from hpcrlhf.data.sft import TokenizedSample, keep_usable
from hpcrlhf.data.sources import rows_from_records
from hpcrlhf.data.tasks import build_task
from hpcrlhf.engines.distributed import DistEnv, all_reduce_tensor
from hpcrlhf.logs import Progress, get_logger
from hpcrlhf.run.files import replace_file
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.batches import eval_shards
from hpcrlhf.trainers.sequences import response_logps
from hpcrlhf.trainers.single_model import SingleModelTrainer

log = get_logger()

CACHE = "reference_logps.pt"
"""The precomputed tables' file in the run folder."""


class OfflinePolicyTrainer(SingleModelTrainer):
    """Each training/eval item holds SEQUENCES_PER_ITEM sequences (a pair's chosen and rejected
    response; a KTO sample and its mismatched sequence). Reference tables lay them out item by
    item, so sequence `part` of item i has id `SEQUENCES_PER_ITEM * i + part` (`sequence_ids`)."""

    SEQUENCES_PER_ITEM = 2

    def build_reference(self, sequences: Callable[[Any], tuple[TokenizedSample, ...]]) -> None:
        """Load the reference; with `reference.precompute`, score every sequence of `self.train`
        and `self.evals` (`sequences(item)` gives an item's) now and free the model."""
        ref = self.cfg.reference
        path, key = (ref.path, "reference.path") if ref.path else (self.cfg.model.path, "model.path")
        model = self.models.build_frozen_model(path, value_head=False, offload=ref.offload, key=key,
                                               micro_batch_rows=self.plan.micro_batch_rows)
        self.reference = Reference(model, path, pad_id=self.pad_id, device=self.engine.device, env=self.env,
                                   batch_size=self.cfg.eval.batch_size,
                                   progress=lambda total, desc: self.run.start_progress(total, 0, desc))
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


def task_pairs(cfg: DPOConfig | KTOConfig, tokenizer) -> list[PairSample]:
    """Held-out (prompt, correct, wrong) pairs from the bundled task (none without a task)."""
    task = build_task(cfg.task, cfg.data)
    if task is None:
        return []
    rows = rows_from_records(task.mixed_preference_rows("eval", cfg.task.eval_size, cfg.task.hard_pair_fraction,
                                                         cfg.task.near_miss),
                             f"task:{task.name}[eval]")
    data = PairDataConfig(max_length=cfg.data.max_length, apply_chat_template=cfg.data.apply_chat_template)
    return keep_usable(*tokenize_pairs(rows, tokenizer, data), split="eval", path=None)


class Reference:
    """The frozen reference model (`model`, loaded from `path`) and its log-probs, computed on `device`
    (the trained engine's) in batches of `batch_size` sequences; `progress(total, desc)` shows the
    precomputation's."""

    def __init__(self, model, path: str, *, pad_id: int, device: torch.device, env: DistEnv, batch_size: int,
                 progress: Callable[[int, str], Progress]) -> None:
        self.model, self.path = model, path
        self.pad_id, self.device, self.env, self.batch_size, self.progress = pad_id, device, env, batch_size, progress
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def logps(self, samples: Sequence[TokenizedSample], table: str, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed response log-probs, response token counts) of `samples`, whose indices in
        `table` are `ids` (used when the table was precomputed)."""
        if table in self.tables:
            sums, counts = self.tables[table]
            index = torch.tensor(list(ids))
            return sums[index].to(self.device), counts[index].to(self.device)
        return response_logps(self.model, samples, self.pad_id, self.device)

    def precompute(self, tables: dict[str, list[TokenizedSample]], run_dir: Path) -> None:
        """Score every sequence of every table once, then free the model."""
        key = _fingerprint(self.path, tables)
        cache = run_dir / CACHE
        if cache.exists():
            saved = torch.load(cache, weights_only=True)
            if saved.get("key") == key:
                self.tables = saved["tables"]
                log.info(f"reference log-probs: reusing {cache}")
        if not self.tables:
            self.tables = {name: self._score_all(seqs) for name, seqs in tables.items()}
            if self.env.is_main:
                replace_file(cache, lambda f: torch.save({"key": key, "tables": self.tables}, f))
        self.model = None  # the reference is not needed any more

    @torch.no_grad()
    def _score_all(self, seqs: list[TokenizedSample]) -> tuple[torch.Tensor, torch.Tensor]:
        sums, counts = torch.zeros(len(seqs), dtype=torch.float64), torch.zeros(len(seqs), dtype=torch.float64)
        batches = eval_shards(list(enumerate(seqs)), self.env, self.batch_size)
        progress = self.progress(len(batches), "reference log-probs")
        for batch, dummy in batches:
            s, c = response_logps(self.model, [sample for _, sample in batch], self.pad_id, self.device)
            if not dummy:
                index = torch.tensor([i for i, _ in batch])
                sums[index], counts[index] = s.double().cpu(), c.double().cpu()
            progress.update(1)
        progress.close()
        return all_reduce_tensor(sums).float(), all_reduce_tensor(counts).float()


def _fingerprint(path: str, tables: dict[str, list[TokenizedSample]]) -> str:
    h = hashlib.sha256(str(Path(path).expanduser().resolve() if Path(path).exists() else path).encode())
    for name in sorted(tables):
        h.update(name.encode())
        for s in tables[name]:
            h.update(repr(s.input_ids).encode() + repr(s.loss_mask).encode())
    return h.hexdigest()
