"""The frozen reference model of DPO and KTO, and its log-probs.

Log-probs come from a live forward pass, or from tables computed once before training
(`reference.precompute`): every sequence a trainer will ask about is scored up front (sharded
over ranks, summed back), the tables are cached in the run folder (a resumed run reuses them
when the sequences and reference are the same) and the model is freed.

Tables are addressed by name ("train", "eval") and a sequence index fixed by the trainer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch

from hpcrlhf.data.sft import TokenizedSample
from hpcrlhf.engines.distributed import all_reduce_tensor
from hpcrlhf.logs import get_logger
from hpcrlhf.run.files import replace_file
from hpcrlhf.trainers.batches import eval_shards
from hpcrlhf.trainers.sequences import response_logps

log = get_logger()

CACHE = "reference_logps.pt"


class Reference:
    def __init__(self, trainer, path: str, *, offload: bool, key: str = "model.path"):
        self.trainer, self.path = trainer, path
        self.model = trainer.models.build_frozen_model(path, value_head=False, offload=offload, key=key,
                                                       micro_batch_rows=trainer.plan.micro_batch_rows)
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def logps(self, samples: Sequence[TokenizedSample], table: str, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed response log-probs, response token counts) of `samples`, whose indices in
        `table` are `ids` (used when the table was precomputed)."""
        device = self.trainer.engine.device
        if table in self.tables:
            sums, counts = self.tables[table]
            index = torch.tensor(list(ids))
            return sums[index].to(device), counts[index].to(device)
        return response_logps(self.model, samples, self.trainer.pad_id, device)

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
            if self.trainer.env.is_main:
                replace_file(cache, lambda f: torch.save({"key": key, "tables": self.tables}, f))
        self.model = None  # the reference is not needed any more

    @torch.no_grad()
    def _score_all(self, seqs: list[TokenizedSample]) -> tuple[torch.Tensor, torch.Tensor]:
        sums, counts = torch.zeros(len(seqs), dtype=torch.float64), torch.zeros(len(seqs), dtype=torch.float64)
        env = self.trainer.env
        batches = eval_shards(list(enumerate(seqs)), env, self.trainer.cfg.eval.batch_size)
        progress = self.trainer.run.start_progress(len(batches), 0, "reference log-probs")
        for batch, dummy in batches:
            s, c = response_logps(self.model, [sample for _, sample in batch], self.trainer.pad_id, self.trainer.engine.device)
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
