"""Rebuild tiny_digits_rm/: the tiny reward model of examples/tiny_ppo_rm.yaml.

A 2-layer Llama sequence classifier (hidden 32, one output) on rlfleet's character tokenizer,
trained from a fixed seed to predict ``charset:allowed=0123456789`` (the share of a text's
non-space characters that are digits) from the text alone. Its training texts are random strings
of printable characters with a random share of digits, the kind of answer a random-init tiny
policy writes, so the PPO example can learn "answer with digits" from the model's score instead
of from the rule. Training takes some seconds on a CPU; the folder is committed, so the example
runs without building it. The output is deterministic in ``--seed`` on one machine (float
arithmetic may differ elsewhere: compare models by their scores, not their bytes).

    uv run --extra cpu python examples/data/make_tiny_rm.py        # rewrites the folder next to this script
    uv run --extra cpu python examples/data/make_tiny_rm.py --out /tmp/rm --steps 200 --seed 1
"""

from __future__ import annotations

import argparse
import random
import string
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).with_name("tiny_digits_rm")
OTHERS = string.ascii_letters + string.punctuation + " "


def digit_share(text: str) -> float:
    """What ``charset:allowed=0123456789`` pays: digits over non-space characters (0.0 if none)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def random_text(rng: random.Random, max_len: int = 14) -> str:
    """0 to ``max_len`` characters, each a digit with one probability drawn per text."""
    share = rng.random()
    return "".join(
        rng.choice(string.digits) if rng.random() < share else rng.choice(OTHERS)
        for _ in range(rng.randint(0, max_len))
    )


def build_model(tokenizer: Any, seed: int) -> Any:
    """A random-init 2-layer Llama sequence classifier with one output, for ``tokenizer``."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return LlamaForSequenceClassification(config)


def train(steps: int = 600, seed: int = 0, batch_size: int = 64) -> tuple[Any, Any]:
    """The trained (model, tokenizer): ``steps`` AdamW steps of squared error on random texts."""
    import torch

    from rlfleet.controller.tokenizers import build_char_tokenizer

    torch.set_num_threads(1)  # identical float sums from run to run on one machine
    tokenizer = build_char_tokenizer(model_max_length=64)
    model = build_model(tokenizer, seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        texts = [random_text(rng) for _ in range(batch_size)]
        target = torch.tensor([digit_share(t) for t in texts])
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        loss = torch.nn.functional.mse_loss(model(**batch).logits.squeeze(-1), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model folder")
    parser.add_argument("--steps", type=int, default=600, help="training steps (64 texts each)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args()
    model, tokenizer = train(args.steps, args.seed)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote the reward model to {args.out}")


if __name__ == "__main__":
    main()
