"""Train a small byte-level BPE tokenizer on a text file with Hugging Face `tokenizers` and save its tokenizer.json.

    python scripts/train_tokenizer.py data/shakespeare.txt data/tokenizer.json [--vocab-size 2048]

For trying `cona data prepare` without a model's own tokenizer: with a published model, use the tokenizer.json that
comes with its weights instead. `<|endoftext|>` is the end-of-document token (id 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", type=Path, help="the training text")
    parser.add_argument("out", type=Path, help="where to write tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tokenizer.train([str(args.text)], trainer=trainer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out))
    print(f"wrote {args.out}: a byte-level BPE of {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
