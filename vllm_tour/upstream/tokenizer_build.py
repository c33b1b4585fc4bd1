"""Build the tiny models' byte-level BPE tokenizer from `data/corpus.txt`.

Run once by a developer (`python -m vllm_tour.upstream.tokenizer_build`); the result,
`data/tokenizer.json`, is checked in so that every machine tokenizes the same
way without retraining (BPE training is not guaranteed stable across
`tokenizers` releases).
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vllm_tour.paths import DATA_DIR as DATA

VOCAB_SIZE = 512  # = the tiny models' vocab_size
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(DATA / "corpus.txt")], trainer)
    return tok


if __name__ == "__main__":
    out = DATA / "tokenizer.json"
    build().save(str(out))
    print(f"wrote {out}")
