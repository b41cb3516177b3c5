#!/usr/bin/env python3
"""Build the byte-level BPE tokenizer of the tiny models (benchmarks/models/tiny-*), so that SGLang can
serve them with a tokenizer and ``python -m sglang.bench_serving`` can run against them.

    python benchmarks/models/build_tokenizer.py            # (re)write the files into every tiny model dir
    python benchmarks/models/build_tokenizer.py --check    # exit 1 if a committed file differs from a rebuild

The training text is generated here, from a fixed seed: a made-up language (a lexicon of words built
from syllables, drawn with Zipf-like frequencies, in sentences with capitals, digits and punctuation).
Nothing is downloaded and nothing is read from this machine, so every run writes the same bytes. The
vocabulary has exactly ``vocab_size`` entries of the model's config.json (32768 for both tiny models):
``<bos>`` (id 0) and ``<eos>`` (id 1), matching the configs' ``bos_token_id`` and ``eos_token_id``, the 256
byte symbols, and the merges learnt from the text. Encoding prepends ``<bos>``, as DeepSeek's tokenizer does.

Files written into each model directory (identical in both, so git stores them once):
  tokenizer.json          the tokenizers model (merges written as "a b" strings: the compact form the
                          library also reads; about 0.87 MB, 0.33 MB compressed in git)
  tokenizer_config.json   what transformers' AutoTokenizer needs (class, special tokens, a plain chat template)

Needs the ``tokenizers`` package (installed with SGLang, which depends on transformers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

MODELS = Path(__file__).resolve().parent
BOS, EOS = "<bos>", "<eos>"
SEED = 20261125
# Size of the generated text and of its lexicon. The lexicon is large and its frequencies flat
# enough that the BPE trainer finds more than 32768 merges, so that the vocabulary is full.
TEXT_WORDS = 1_500_000
LEXICON_WORDS = 200_000
ZIPF_EXPONENT = 0.6
# Text handed to the trainer per item (the iterator keeps memory flat).
TRAIN_CHUNK_CHARS = 10_000
# A chat template for /v1/chat/completions: role and text per line, then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_ONSETS = list("bcdfghklmnprstvwz") + ["", "br", "st", "tr", "ch", "sh"]
_VOWELS = list("aeiou") + ["ai", "ou", "ea"]
_CODAS = ["", "", "n", "r", "s", "t", "l"]
_ENDINGS = ".....?!,;:"


def synthetic_text(seed: int = SEED, words: int = TEXT_WORDS, lexicon_words: int = LEXICON_WORDS) -> str:
    """Sentences of a made-up language, the same for the same arguments (``random.Random(seed)``)."""
    rng = random.Random(seed)
    syllables = [onset + vowel + coda for onset in _ONSETS for vowel in _VOWELS for coda in _CODAS]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3)))) for _ in range(lexicon_words)]
    cumulative = list(itertools.accumulate(1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(lexicon_words)))
    drawn = rng.choices(lexicon, cum_weights=cumulative, k=words)
    sentences, start = [], 0
    while start < len(drawn):
        length = rng.randint(4, 18)
        sentence = drawn[start : start + length]
        start += length
        if rng.random() < 0.2:
            sentence.insert(rng.randrange(len(sentence) + 1), str(rng.randint(0, 9999)))
        text = " ".join(sentence)
        sentences.append(text[:1].upper() + text[1:] + rng.choice(_ENDINGS))
    return " ".join(sentences)


def train(vocab_size: int) -> str:
    """The tokenizer.json text of a byte-level BPE with exactly ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = synthetic_text()
    tokenizer.train_from_iterator(
        (text[i : i + TRAIN_CHUNK_CHARS] for i in range(0, len(text), TRAIN_CHUNK_CHARS)), trainer
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise SystemExit(
            f"the trainer found only {tokenizer.get_vocab_size()} tokens, not {vocab_size}: raise TEXT_WORDS or "
            f"LEXICON_WORDS in {Path(__file__).name}"
        )
    if tokenizer.token_to_id(BOS) != 0 or tokenizer.token_to_id(EOS) != 1:
        raise SystemExit(f"{BOS} and {EOS} must get ids 0 and 1 (the tiny configs' bos_token_id and eos_token_id)")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)]
    )
    data = json.loads(tokenizer.to_str())
    # "a b" strings instead of ["a", "b"] pairs: a third smaller, read by every tokenizers release.
    # Byte-level symbols never contain a space (it is mapped to "Ġ"), so the split is unambiguous.
    data["model"]["merges"] = [" ".join(pair) if isinstance(pair, list) else pair for pair in data["model"]["merges"]]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def tokenizer_config(model_config: dict) -> str:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_config.get("max_position_embeddings", 163840),
        "chat_template": CHAT_TEMPLATE,
    }
    return json.dumps(config, indent=2) + "\n"


def model_dirs() -> list[Path]:
    return sorted(path.parent for path in MODELS.glob("*/config.json"))


def expected_files(model_dir: Path, trained: dict[int, str]) -> dict[Path, str]:
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config["vocab_size"]
    if vocab_size not in trained:
        trained[vocab_size] = train(vocab_size)
    return {
        model_dir / "tokenizer.json": trained[vocab_size],
        model_dir / "tokenizer_config.json": tokenizer_config(config),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare the committed files with a rebuild; write nothing")
    parser.add_argument(
        "model_dirs", nargs="*", type=Path,
        help="model directories (default: every benchmarks/models/*/ with a config.json)",
    )
    args = parser.parse_args(argv)
    trained: dict[int, str] = {}
    stale = []
    for model_dir in args.model_dirs or model_dirs():
        for path, text in expected_files(model_dir, trained).items():
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(path)
            else:
                path.write_text(text)
                print(f"wrote {path} ({len(text.encode()):,} bytes)")
    if stale:
        print("differ from a rebuild (run benchmarks/models/build_tokenizer.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
