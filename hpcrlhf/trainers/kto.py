"""Kahneman-Tversky optimisation (KTO) on unpaired desirable/undesirable completions.

Each step first estimates the reference point z0 = KL(policy || reference) over the whole global
batch, on mismatched sequences (each prompt followed by another row's completion, see
`data.preference`): policy and reference score them without gradients and the mean log-ratio is
summed over ranks. Then `algos.preference.kto_loss` pushes desirable completions' log-ratio above
z0 and undesirable ones' below it, with separate weights (Ethayarajh et al. 2024).
"""

from __future__ import annotations

import torch

from hpcrlhf.algos.preference import kto_loss
from hpcrlhf.config.schema import KTOConfig
from hpcrlhf.data.preference import UnpairedSample, load_unpaired
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.loop import merge_evaluation
from hpcrlhf.trainers.offline_policy import OfflinePolicyTrainer, task_pairs


class KTOTrainer(OfflinePolicyTrainer):
    kind = "kto"

    def __init__(self, cfg: KTOConfig):
        self.setup(cfg)
        self.train, self.evals = load_unpaired(cfg.data, cfg.task, self.tokenizer)
        self.build_engine(len(self.train))
        self.build_reference(lambda u: (u.sample, u.mismatched))
        self.pairs = task_pairs(cfg, self.tokenizer)

    @torch.no_grad()
    def kl_estimate(self, rows: list[UnpairedSample], table: str, indices: list[int]) -> torch.Tensor:
        """Mean policy-minus-reference log-ratio of the mismatched sequences, over all ranks."""
        total = 0.0
        for start in range(0, len(rows), self.plan.micro_batch_rows):
            part = slice(start, start + self.plan.micro_batch_rows)
            policy, ref, _ = self.logps([u.mismatched for u in rows[part]], table, self.sequence_ids(indices[part], 1))
            total += float((policy - ref).sum())
        total, count = all_reduce_sum([total, len(rows)])
        return torch.tensor(total / count, device=self.engine.device)

    def sample_loss(self, rows: list[UnpairedSample], table: str, indices: list[int], kl: torch.Tensor, prefix: str
                    ) -> tuple[torch.Tensor, int, Stats]:
        cfg = self.cfg.kto
        policy, ref, counts = self.logps([u.sample for u in rows], table, self.sequence_ids(indices, 0))
        desirable = torch.tensor([u.desirable for u in rows], device=policy.device)
        out = kto_loss(policy, ref, desirable, kl, beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                       undesirable_weight=cfg.undesirable_weight)
        rewards = (cfg.beta * (policy - ref)).detach()
        n_d = int(desirable.sum())
        stats = {f"{prefix}/reward_desirable": (float(rewards[desirable].sum()), n_d),
                 f"{prefix}/reward_undesirable": (float(rewards[~desirable].sum()), len(rows) - n_d),
                 f"{prefix}/kl": (float(out.kl) * len(rows), len(rows))}
        return out.loss, int(counts.sum()), stats

    def train_step(self, step: int) -> dict[str, float]:
        indices = self.plan.rows_for_step(len(self.train), step, self.cfg.seed, self.env.rank)
        self.engine.eval()  # the KL estimate is a measurement: no dropout
        kl = self.kl_estimate([self.train[i] for i in indices], "train", indices)
        return self.sample_mean_step(step, len(self.train), lambda idx: self.sample_loss(
            [self.train[i] for i in idx], "train", idx, kl, "train"))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        out: dict[str, float] = {}
        if self.evals:
            indices = list(range(len(self.evals)))
            kl = self.kl_estimate(self.evals, "eval", indices)

            def stats(batch: list) -> Stats:
                loss, _, s = self.sample_loss([u for _, u in batch], "eval", [i for i, _ in batch], kl, "eval")
                return {"eval/loss": (float(loss) * len(batch), len(batch)), **s}

            out = self.eval_means(list(enumerate(self.evals)), stats)
            if "eval/reward_desirable" in out and "eval/reward_undesirable" in out:
                out["eval/reward_margin"] = out["eval/reward_desirable"] - out["eval/reward_undesirable"]
        return merge_evaluation(out, self.policy_preferences(self.pairs), self.generation_scores(self.score_prompts()))


def run_kto(cfg: KTOConfig) -> dict:
    return KTOTrainer(cfg).fit()
