"""Where a process's models come from: one factory for every trainer and every Ray role worker.

`ModelFactory(cfg)` joins the process's group (torch.distributed, from the launcher's
environment), seeds it and loads the tokenizer; then it builds models as the job's config says --
a causal LM or a one-label value model (`load_model`), in a DeepSpeed training engine with its
optimizer and LoRA (`build_trained_model`) or frozen for forward passes (`build_frozen_model`) --
and exports a trained one in Hugging Face format (`export`). A trainer owns the run around it
(folder, metrics, loop); a Ray role worker only builds and serves its model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hpcrlhf.engines.deepspeed_engine import (FrozenModel, TrainingEngine, build_deepspeed_config,
                                              build_frozen_deepspeed_config, maybe_zero3_init_context,
                                              prepare_extensions, save_hf_model, zero3_init_paused)
from hpcrlhf.engines.distributed import device_for, init_distributed
from hpcrlhf.config.schema import TrainJobConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.models.export import export_pretrained
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
from hpcrlhf.models.lora import apply_lora, quantization_config
from hpcrlhf.models.moe import has_router
from hpcrlhf.models.value import ValueModel, load_value_model


def trainable_parameters(engine) -> int:
    """How many of an engine's parameters are trained (all, or LoRA's adapters)."""
    return sum(p.numel() for p in engine.module.parameters() if p.requires_grad)


class ModelFactory:
    def __init__(self, cfg: TrainJobConfig) -> None:
        self.cfg = cfg
        self.env = init_distributed()
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id
        self._zero3_ctx = None  # the trained model's ZeRO-3 init context, alive while models load

    @property
    def device(self) -> torch.device:
        return device_for(self.env.local_rank)

    def load_model(self, path: str, *, value_head: bool, key: str = "model.path") -> torch.nn.Module:
        """A transformers model from `path` (named by config field `key`): a causal LM, or with
        `value_head` a one-label sequence-classification model (no LoRA, not yet in an engine)."""
        cfg = self.cfg
        kw = dict(attn_implementation=cfg.model.attn_implementation, dtype=cfg.engine.precision,
                  trust_remote_code=cfg.model.trust_remote_code, quantization_config=quantization_config(cfg.lora),
                  key=key)
        if value_head:
            return load_value_model(path, pad_token_id=self.pad_id, **kw)
        return load_causal_lm(path, **kw)

    def build_trained_model(self, path: str, *, value_head: bool, optim, micro_batch_rows: int, grad_accum_steps: int,
                            total_steps: int, key: str = "model.path"):
        """A model from `path` (causal LM or value model, LoRA when configured) in a DeepSpeed
        training engine with its own optimizer and schedule."""
        cfg = self.cfg
        ds_config = build_deepspeed_config(cfg.engine, optim, micro_batch_size=micro_batch_rows,
                                           grad_accum_steps=grad_accum_steps, world_size=self.env.world_size)
        prepare_extensions(ds_config)
        self._zero3_ctx = maybe_zero3_init_context(ds_config)
        model = self.load_model(path, value_head=value_head, key=key)
        if cfg.model.router_aux_loss_coef and not value_head:
            if not has_router(model.config):
                raise ConfigError(f"model.router_aux_loss_coef: {cfg.model.router_aux_loss_coef}, but {key} {path} "
                                  f"({model.config.model_type}) is no mixture-of-experts model: it has no router to "
                                  "balance; use 0")
        if cfg.lora.rank:
            model = apply_lora(model, cfg.lora, value_head=value_head,
                               gradient_checkpointing=cfg.engine.gradient_checkpointing)
        if value_head:
            model = ValueModel(model)
        return TrainingEngine(model, ds_config, optim=optim, total_steps=total_steps,
                              gradient_checkpointing=cfg.engine.gradient_checkpointing)

    def build_frozen_model(self, path: str, *, value_head: bool, offload: bool = False, micro_batch_rows: int = 1,
                           key: str = "model.path"):
        """A model used for forward passes only (reference, reward model): replicated at ZeRO 0-2,
        sharded like the trained model at ZeRO-3 (optionally with its weights kept on the CPU)."""
        ds_config = build_frozen_deepspeed_config(self.cfg.engine, offload=offload, micro_batch_size=micro_batch_rows,
                                                  world_size=self.env.world_size)
        ctx = maybe_zero3_init_context(ds_config) if ds_config else None  # shard while loading
        model = self.load_model(path, value_head=value_head, key=key)
        frozen = FrozenModel(ValueModel(model) if value_head else model, ds_config, self.device)
        if ctx is not None and self._zero3_ctx is not None:
            # give transformers back the trained model's ZeRO-3 config
            from transformers.integrations.deepspeed import set_hf_deepspeed_config

            set_hf_deepspeed_config(self._zero3_ctx)
        return frozen

    def export(self, engine, *, value_head: bool, config_updates: dict[str, Any] | None = None,
               files: dict[str, str] | None = None, folder: str = "model") -> None:
        """Write `engine`'s model in Hugging Face format into `folder` (`model/`, or `best/`) of the run
        folder (LoRA adapters merged, the adapter alone in `adapter/` there; every rank calls: ZeRO-3
        gathers). `config_updates`: extra entries for its config.json; `files`: more files (name -> text)."""
        def build_base():
            with zero3_init_paused():
                return self.load_model(self.cfg.model.path, value_head=value_head)

        save_hf_model(engine, lambda state: export_pretrained(
            engine.module, state, Path(self.cfg.output_dir) / folder, self.tokenizer,
            lora=self.cfg.lora, build_base=build_base, config_updates=config_updates or {}, files=files))
