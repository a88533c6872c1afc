"""Reward model (RM) training on preference pairs.

The model is the backbone plus a scalar head (`models/value.py`); a sequence's reward is the
head's value at its last token (the EOS). Loss: the Bradley-Terry pairwise loss
-log sigmoid(r_chosen - r_rejected - margin), averaged over the global batch of pairs.
Evaluation reports held-out pairwise accuracy (overall and per difficulty tag) and the mean and
standard deviation of the held-out rewards; the exported model carries those two numbers in its
config.json (`reward_mean`, `reward_std`) so PPO can normalise its rewards.
"""

from __future__ import annotations

import math

import torch

from hpcrlhf.algos.preference import pairwise_rm_loss
from hpcrlhf.config.schema import RMConfig
from hpcrlhf.data.preference import PairSample, load_pairs
from hpcrlhf.models.value import REWARD_MEAN, REWARD_STD, last_token_values
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.sequences import model_batch
from hpcrlhf.trainers.single_model import SingleModelTrainer

STATS_SAMPLE = 1024
"""Training pairs used for the reward statistics when there is no held-out data."""
_MEAN, _SQUARE = "moments/reward", "moments/reward_squared"


class RMTrainer(SingleModelTrainer):
    kind = "rm"
    value_head = True

    def __init__(self, cfg: RMConfig):
        self.setup(cfg)
        self.train, self.evals = load_pairs(cfg.data, cfg.task, self.tokenizer)
        self.tags = sorted({p.tag for p in self.evals if p.tag})
        self.build_engine(len(self.train))

    def rewards(self, pairs: list[PairSample]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Rewards of the chosen and of the rejected responses, and the tokens processed."""
        batch = model_batch([p.chosen for p in pairs] + [p.rejected for p in pairs], self.pad_id, self.engine.device)
        batch.pop("labels")
        rewards = last_token_values(self.engine(**batch), batch["attention_mask"])
        return rewards[: len(pairs)], rewards[len(pairs) :], int(batch["attention_mask"].sum())

    def pair_stats(self, pairs: list[PairSample], prefix: str, moments: bool = False) -> tuple[torch.Tensor, int, Stats]:
        """Loss, tokens and statistics of a batch of pairs; with `moments`, also the first two
        moments of all its rewards (for the normalisation statistics)."""
        chosen, rejected, tokens = self.rewards(pairs)
        c, r = chosen.detach(), rejected.detach()
        margin = torch.tensor([p.margin for p in pairs], device=chosen.device) if self.cfg.data.margin_key else None
        loss, accuracy = pairwise_rm_loss(chosen, rejected, margin)
        n = len(pairs)
        right = (c > r).tolist()
        stats = {f"{prefix}/accuracy": (float(accuracy) * n, n),
                 f"{prefix}/reward_chosen": (float(c.sum()), n),
                 f"{prefix}/reward_rejected": (float(r.sum()), n),
                 **{f"{prefix}/accuracy_{tag}": (sum(r for r, p in zip(right, pairs) if p.tag == tag),
                                                 sum(p.tag == tag for p in pairs)) for tag in self.tags}}
        if moments:
            both = torch.cat([c, r]).double()
            stats[_MEAN], stats[_SQUARE] = (float(both.sum()), 2 * n), (float((both * both).sum()), 2 * n)
        return loss, tokens, stats

    def train_step(self, step: int) -> dict[str, float]:
        return self.sample_mean_step(step, len(self.train),
                                     lambda idx: self.pair_stats([self.train[i] for i in idx], "train"))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pair metrics and the reward mean/std, in one pass (the mean/std come from
        training pairs when there is no held-out data)."""
        self.engine.eval()

        def stats(pairs: list[PairSample]) -> Stats:
            loss, _, out = self.pair_stats(pairs, "eval", moments=True)
            return {"eval/loss": (float(loss) * len(pairs), len(pairs)), **out}

        metrics = self.eval_means(self.evals or self.train[:STATS_SAMPLE], stats)
        mean, square = metrics.pop(_MEAN), metrics.pop(_SQUARE)
        self.moments = {"eval/reward_mean": mean, "eval/reward_std": math.sqrt(max(square - mean**2, 0.0))}
        return {**(metrics if self.evals else {}), **self.moments}

    def exported_config(self) -> dict[str, float]:
        # `fit` evaluates the final model right before exporting it.
        return {REWARD_MEAN: self.moments["eval/reward_mean"], REWARD_STD: self.moments["eval/reward_std"]}


def run_rm(cfg: RMConfig) -> dict:
    return RMTrainer(cfg).fit()
