"""Train a small byte-level BPE tokenizer on text with Hugging Face `tokenizers` and save its tokenizer.json.

    python scripts/train_tokenizer.py data/shakespeare.txt [MORE_TEXT...] data/tokenizer.json [--vocab-size 2048]

For trying `cona data prepare` without a model's own tokenizer: with a published model, use the tokenizer.json that
comes with its weights instead. `<|endoftext|>` is the end-of-document token (id 0). The text is read as `cona data
prepare` reads it (files, directories of them or quoted globs; compressed files decompressed, UTF-8 without a byte
order mark, binary files refused), line by line as `tokenizers` reads a file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MIN_VOCAB = 257
"""The 256 byte tokens and <|endoftext|>: a byte-level BPE has at least these, whatever --vocab-size says."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", nargs="+", type=Path, help="the training text: files, directories of them or quoted globs")
    parser.add_argument("out", type=Path, help="where to write tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)
    from cona.trainer.prepare import check_text_file, input_files, text_lines
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    try:
        if args.vocab_size < MIN_VOCAB:
            raise ValueError(f"--vocab-size {args.vocab_size}: a byte-level BPE has at least {MIN_VOCAB} tokens (256 "
                             "bytes and <|endoftext|>)")  # fmt: skip
        files = input_files(args.text, option="text")
        if not any([check_text_file(path) for path in files]):  # every file checked, not only up to a non-empty one
            raise ValueError(f"{' '.join(map(str, args.text))}: no text to train on (the input is empty)")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
        tokenizer.train_from_iterator(text_lines(files), trainer=trainer)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(args.out))
    except (OSError, ValueError) as e:  # one line, as cona's own: a bad path is no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: a byte-level BPE of {tokenizer.get_vocab_size()} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
