"""A small deterministic byte-level BPE tokenizer, built in-process (no hub access).

Every zoo twin ships this tokenizer, so that every engine (HF, TransformerLens, nnsight, vLLM)
tokenizes a prompt into the same ids. Byte-level BPE covers every byte, so any text round-trips.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 512
BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0, 1, 2, 3

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "Interpretability research studies the internal activations of neural networks.",
    "A transformer has attention layers and multilayer perceptron layers, with a residual stream.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "In 1969, astronauts landed on the Moon for the first time.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The model predicts the next token given all of the previous tokens in the sequence.",
    "She said: \"I will be there at 5 o'clock, don't be late!\"",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "When Mary and John went to the store, John gave a drink to Mary.",
    "Steering vectors are added to the residual stream to change the behaviour of the model.",
    "The sliding window attention only looks at the most recent tokens of the context.",
]


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # repeat the corpus so the merge counts are unambiguous; training is single-threaded and
    # deterministic for a fixed input
    tok.train_from_iterator(_CORPUS * 3, trainer=trainer, length=len(_CORPUS) * 3)
    return tok.to_str()


@functools.lru_cache(maxsize=1)
def _cached_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=512,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return fast


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Return the zoo tokenizer (a ``PreTrainedTokenizerFast``; the same object on every call).

    Special ids: pad 0, bos 1, eos 2, unk 3; vocabulary size 512. Encoding adds no special tokens.
    """
    return _cached_tokenizer()


def special_token_ids() -> dict[str, int]:
    tok = build_tokenizer()
    return {
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "unk_token_id": tok.unk_token_id,
    }
