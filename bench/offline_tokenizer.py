"""Train a small byte-level BPE tokenizer offline, for tools that want a Hugging Face tokenizer and cannot
download one (the real-vLLM tests, the external load tool). Run by another venv's Python, by file path; it needs
only `tokenizers` (and `faker` without training files):

    python offline_tokenizer.py OUT_FOLDER VOCAB_SIZE [FILE ...]

It trains on the given text files, or without any on 5,000 paragraphs of Faker's English (seeded), writes
OUT_FOLDER/tokenizer.json and prints the vocabulary size it reached.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["SCRIPT", "main"]

# The path another venv's Python runs; the module imports nothing outside the standard library until main().
SCRIPT = Path(__file__)


def main(argv: list[str]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out, vocab_size, *paths = argv
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if paths:
        tokenizer.train(paths, trainer)
    else:
        from faker import Faker

        fake = Faker()
        fake.seed_instance(0)
        tokenizer.train_from_iterator([fake.paragraph(nb_sentences=8) for _ in range(5000)], trainer)
    tokenizer.save(out + "/tokenizer.json")
    print(tokenizer.get_vocab_size())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
