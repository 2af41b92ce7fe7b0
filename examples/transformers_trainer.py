"""Train a tiny GPT-2 with the HF Trainer in float16, with lossscale's GradScaler and its logs.

    python examples/transformers_trainer.py [OUTPUT_DIR]

Runs in seconds on CPU (float16 autocast there needs ``fp16_on_cpu=True``) or on a GPU. Needs the transformers
extra: ``pip install '.[transformers]'`` in a clone of this repository. The model is built from a config: nothing is
downloaded.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lossscale.integrations.transformers import LossScaleCallback, use_lossscale


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random token ids; the model learns their unigram statistics."""

    def __init__(self, count: int = 64, length: int = 16, vocab: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(output_dir: str) -> list[dict[str, float]]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    on_cpu = not torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=output_dir,
        fp16=True,
        use_cpu=on_cpu,
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=RandomTokens(), callbacks=[LossScaleCallback()]
    )  # adds loss_scale, skipped_steps to the logs
    use_lossscale(trainer, fp16_on_cpu=on_cpu, growth_interval=4)  # before train(); GradScaler's arguments
    trainer.train()
    steps = [log for log in trainer.state.log_history if "loss" in log]
    for log in steps:
        print(
            f"step {log['step']:3d}  loss {log['loss']:.4f}  lr {log['learning_rate']:.2e}  "
            f"loss_scale {log['loss_scale']:8.0f}  skipped_steps {log['skipped_steps']}"
        )
    return steps


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="lossscale-trainer-") as tmp:
            main(tmp)
