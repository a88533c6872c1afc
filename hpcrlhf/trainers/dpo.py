"""Direct preference optimisation: DPO, IPO and cDPO against a frozen reference.

For each pair the policy and the reference score the chosen and the rejected response (summed
response log-probs; token-averaged for IPO, as Azar et al. define it) and `algos.preference.
dpo_loss` turns them into the loss, averaged over the global batch of pairs. An optional NLL term
on the chosen responses (`dpo.nll_coef`) keeps their likelihood from falling.

Logged: the implicit rewards beta * (policy - reference) of chosen and rejected responses, their
margin and accuracy; at evaluation also the policy's own preference for correct answers on
held-out pairs and its task score.
"""

from __future__ import annotations

import torch

from hpcrlhf.algos.preference import dpo_loss
from hpcrlhf.config.schema import DPOConfig
from hpcrlhf.data.preference import PairSample, load_pairs
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.loop import merge_evaluation
from hpcrlhf.trainers.offline_policy import OfflinePolicyTrainer


class DPOTrainer(OfflinePolicyTrainer):
    kind = "dpo"

    def __init__(self, cfg: DPOConfig):
        self.setup(cfg)
        self.train, self.evals = load_pairs(cfg.data, cfg.task, self.tokenizer)
        self.build_engine(len(self.train))
        self.build_reference(lambda p: (p.chosen, p.rejected))

    def pair_loss(self, pairs: list[PairSample], table: str, indices: list[int], prefix: str
                  ) -> tuple[torch.Tensor, int, Stats]:
        cfg, n = self.cfg.dpo, len(pairs)
        policy, ref, counts = self.logps([p.chosen for p in pairs] + [p.rejected for p in pairs], table,
                                         self.sequence_ids(indices, 0) + self.sequence_ids(indices, 1))
        nll = -policy[:n] / counts[:n].clamp(min=1)  # mean token NLL of each chosen response
        if cfg.loss == "ipo":
            policy, ref = policy / counts.clamp(min=1), ref / counts.clamp(min=1)
        out = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], beta=cfg.beta, loss_type=cfg.loss,
                       label_smoothing=cfg.label_smoothing)
        loss = out.loss
        if cfg.nll_coef:
            loss = loss + cfg.nll_coef * nll.mean()
        stats = {f"{prefix}/reward_chosen": (float(out.chosen_rewards.sum()), n),
                 f"{prefix}/reward_rejected": (float(out.rejected_rewards.sum()), n),
                 f"{prefix}/reward_margin": (float(out.margins.sum()), n),
                 f"{prefix}/reward_accuracy": (float(out.accuracy) * n, n),
                 f"{prefix}/chosen_nll": (float(nll.detach().sum()), n)}
        return loss, int(counts.sum()), stats

    def train_step(self, step: int) -> dict[str, float]:
        return self.sample_mean_step(step, len(self.train), lambda idx: self.pair_loss(
            [self.train[i] for i in idx], "train", idx, "train"))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        indexed = list(enumerate(self.evals))

        def stats(batch: list) -> Stats:
            loss, _, out = self.pair_loss([p for _, p in batch], "eval", [i for i, _ in batch], "eval")
            return {"eval/loss": (float(loss) * len(batch), len(batch)), **out}

        return merge_evaluation(self.eval_means(indexed, stats), self.policy_preferences(self.evals),
                                self.generation_scores(self.score_prompts()))


def run_dpo(cfg: DPOConfig) -> dict:
    return DPOTrainer(cfg).fit()
