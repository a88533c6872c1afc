"""Supervised fine-tuning (SFT).

Loss: mean next-token negative log-likelihood over the response tokens (and EOS) of every sample
in the global batch. Computed as a token sum normalised by the global token count, so the result
does not depend on how the batch is split over ranks, micro-batches or packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrlhf.agents.render import conversation_problem, tokenize_conversations
from hpcrlhf.algos.logprobs import nll_sum
from hpcrlhf.config.schema import SFTConfig
from hpcrlhf.data.batching import collate, pack_rows
from hpcrlhf.data.loading import load_rows
from hpcrlhf.data.sft import TokenizedSample, keep_usable, tokenize_sft
from hpcrlhf.data.sources import Row, require_text
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.errors import DataError
from hpcrlhf.models.moe import router_kwargs
from hpcrlhf.trainers.loop import merge_evaluation
from hpcrlhf.trainers.sequences import model_batch
from hpcrlhf.trainers.single_model import SingleModelTrainer


@dataclass(frozen=True)
class SFTData:
    train_rows: list[list[TokenizedSample]]
    """Training rows in a fixed order (one sample each, or several when packed)."""
    eval_samples: list[TokenizedSample]


def load_sft_rows(cfg: SFTConfig) -> tuple[list[Row], list[Row]]:
    """Checked train and eval rows from the configured files, or from the bundled task."""
    data = cfg.data
    train, evals = load_rows(data, cfg.task, lambda task, split, n: task.sft_rows(split, n))
    if data.messages_key is not None:
        for rows in (train, evals):
            for row in rows:
                problem = conversation_problem(row.data.get(data.messages_key))
                if problem is not None:
                    raise DataError(f"{row.origin}: the row's '{data.messages_key}' (data.messages_key) is no "
                                    f"conversation: {problem}; give a list of {{'role', 'content'}} messages with "
                                    "at least one assistant turn")
        return train, evals
    options = {data.prompt_key: "data.prompt_key", data.response_key: "data.response_key"}
    for rows in (train, evals):
        require_text(rows, (data.prompt_key, data.response_key), key_option=options)
    return train, evals


def build_sft_data(cfg: SFTConfig, tokenizer, train_rows: list[Row], eval_rows: list[Row]) -> SFTData:
    if cfg.data.messages_key is not None:
        def tokenize(rows):
            return tokenize_conversations(rows, tokenizer, messages_key=cfg.data.messages_key,
                                          tools_key=cfg.data.tools_key, max_length=cfg.data.max_length)
    else:
        def tokenize(rows):
            return tokenize_sft(rows, tokenizer, prompt_key=cfg.data.prompt_key, response_key=cfg.data.response_key,
                                max_length=cfg.data.max_length, apply_chat_template=cfg.data.apply_chat_template)
    train = keep_usable(*tokenize(train_rows), split="training", path=cfg.data.train_path)
    evals = keep_usable(*tokenize(eval_rows), split="eval", path=cfg.data.eval_path)
    if cfg.data.packing:
        # Shuffle once before packing so each packed row mixes samples; rows are then reshuffled
        # per epoch like unpacked samples.
        g = torch.Generator().manual_seed(cfg.seed)
        train = [train[i] for i in torch.randperm(len(train), generator=g).tolist()]
        rows = [[train[i] for i in group] for group in pack_rows([len(s.input_ids) for s in train], cfg.data.max_length)]
    else:
        rows = [[s] for s in train]
    return SFTData(rows, evals)


class SFTTrainer(SingleModelTrainer):
    kind = "sft"

    def __init__(self, cfg: SFTConfig):
        self.setup(cfg)
        self.data = self.build_data()
        self.build_engine(len(self.data.train_rows))

    def build_data(self) -> SFTData:
        return build_sft_data(self.cfg, self.tokenizer, *load_sft_rows(self.cfg))

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        rows = [self.data.train_rows[i] for i in self.plan.rows_for_step(len(self.data.train_rows), step, self.cfg.seed, self.env.rank)]
        return nll_step(self, rows, self.cfg.data.packing)

    # -- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        return merge_evaluation(self.eval_means(self.data.eval_samples, self._eval_loss), self.answer_scores())

    def answer_scores(self) -> dict[str, float]:
        """Task score and `eval.metrics` of greedy answers to the held-out prompts."""
        return self.generation_scores(self.score_prompts())

    def _eval_loss(self, samples: list[TokenizedSample]) -> dict[str, tuple[float, float]]:
        batch = model_batch(samples, self.pad_id, self.engine.device)
        labels = batch.pop("labels")
        nll, n = nll_sum(self.engine(**batch).logits, labels)
        return {"eval/loss": (float(nll), n)}


def nll_step(trainer: SingleModelTrainer, rows: list[list[TokenizedSample]], packed: bool) -> dict[str, float]:
    """One optimizer step of `trainer.engine` on the mean token NLL of this rank's `rows` and
    every other rank's (normalised by the global token count)."""
    engine, micro_rows, world = trainer.engine, trainer.plan.micro_batch_rows, trainer.env.world_size
    coef = trainer.cfg.model.router_aux_loss_coef
    micro = [collate(rows[i : i + micro_rows], trainer.pad_id, packed) for i in range(0, len(rows), micro_rows)]
    local_tokens = sum(int((b["labels"] != -100).sum()) for b in micro)
    global_tokens, global_samples, global_micro = all_reduce_sum([local_tokens, sum(len(r) for r in rows), len(micro)])
    engine.train()
    loss_sum = aux_sum = 0.0
    for batch in micro:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        labels = batch.pop("labels")
        out = engine(**batch, **router_kwargs(coef))
        nll, _ = nll_sum(out.logits, labels)
        loss = nll * world / global_tokens
        if coef:  # the router loss is a mean per forward: averaged over every micro-batch of every rank
            loss = loss + coef * out.aux_loss * world / global_micro
            aux_sum += float(out.aux_loss.detach())
        engine.backward(loss)
        engine.step()
        loss_sum += float(nll.detach())
    total_loss, total_aux = all_reduce_sum([loss_sum, aux_sum])
    router = {"train/router_aux_loss": total_aux / global_micro} if coef else {}
    return {"train/loss": total_loss / global_tokens, "train/tokens": global_tokens, "train/samples": global_samples,
            **router}


def run_sft(cfg: SFTConfig) -> dict:
    return SFTTrainer(cfg).fit()
