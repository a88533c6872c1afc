"""Conditional SFT (decision-transformer-style alignment).

Every training response comes with a reward; the reward's bucket is written into the prompt
(`csft.template`, e.g. "<score 1> 12+34=") and the model is fine-tuned with the ordinary SFT
loss. The model learns what responses of each quality look like, so at generation time asking
for the top bucket asks for the best behaviour. Evaluation reports the task score and
`eval.metrics` when conditioned on the top and on the bottom bucket (`eval/<name>_top`,
`_bottom`); `model/csft.json` records the template and bucket edges for generation.

With the bundled task, the rows are the task's labelled completions (half right, half wrong)
with the exact task score as reward.
"""

from __future__ import annotations

import json
from dataclasses import replace

from hpcrlhf.algos.conditioning import bucket_edges, bucket_of
from hpcrlhf.config.schema import CSFTConfig
from hpcrlhf.data.loading import load_rows
from hpcrlhf.data.sources import Row, require_number, require_text
from hpcrlhf.errors import DataError
from hpcrlhf.trainers.sft import SFTData, SFTTrainer, build_sft_data

META = "csft.json"


def task_reward_rows(task, split: str, n: int) -> list[dict]:
    """The task's labelled completions as (prompt, response, reward = exact task score)."""
    return [{"prompt": r["prompt"], "response": r["completion"], "reward": task.score(r["prompt"], r["completion"])}
            for r in task.unpaired_rows(split, n)]


class CSFTTrainer(SFTTrainer):
    kind = "csft"

    def condition(self, prompt: str, bucket: int) -> str:
        return self.cfg.csft.template.format(bucket=bucket, prompt=prompt)

    def build_data(self) -> SFTData:
        data = self.cfg.data
        if data.train_path is None:  # the task's rows carry their own field names
            data_keys = ("prompt", "response", "reward")
        else:
            data_keys = (data.prompt_key, data.response_key, data.reward_key)
        train, evals = load_rows(data, self.cfg.task, task_reward_rows)
        for rows in (train, evals):
            require_text(rows, data_keys[:2], key_option={data_keys[0]: "data.prompt_key", data_keys[1]: "data.response_key"})
            require_number(rows, data_keys[2], option="data.reward_key")
        try:
            self.edges = bucket_edges([r.data[data_keys[2]] for r in train], self.cfg.csft.num_buckets)
        except ValueError as e:
            source = data.train_path or f"task {self.cfg.task.name!r}"
            raise DataError(f"{source}: data.reward_key '{data_keys[2]}': {e}") from None

        def conditioned(rows: list[Row]) -> list[Row]:
            return [Row({"prompt": self.condition(r.data[data_keys[0]], bucket_of(r.data[data_keys[2]], self.edges)),
                         "response": r.data[data_keys[1]]}, r.origin) for r in rows]

        cfg = replace(self.cfg, data=replace(data, prompt_key="prompt", response_key="response"))
        return build_sft_data(cfg, self.tokenizer, conditioned(train), conditioned(evals))

    def answer_scores(self) -> dict[str, float]:
        """Task score and `eval.metrics` of answers conditioned on the top bucket (`eval/<name>_top`)
        and on the bottom one (`_bottom`); unconditioned prompts are not what this model is for."""
        top = self.cfg.csft.num_buckets - 1
        return {**self.generation_scores(self.score_prompts(lambda p: self.condition(p, top)), "_top"),
                **self.generation_scores(self.score_prompts(lambda p: self.condition(p, 0)), "_bottom")}

    def exported_files(self) -> dict[str, str]:
        meta = {"template": self.cfg.csft.template, "num_buckets": self.cfg.csft.num_buckets,
                "bucket_edges": self.edges, "top_bucket": self.cfg.csft.num_buckets - 1}
        return {META: json.dumps(meta, indent=2) + "\n"}


def run_csft(cfg: CSFTConfig) -> dict:
    return CSFTTrainer(cfg).fit()
