"""Small byte-level BPE tokenizers trained on the spot (nothing is downloaded): the default
mesh's tokenizer (build_tokenizer.py), the tests, the benchmarks and the real-vLLM model
directory (skymesh/testing/vllm_env.py) all train theirs here. In ``assets``, below the
testing helpers, so that the asset builder imports it downward; nothing the daemons run
imports it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def train_byte_bpe(corpus: Iterable[str], vocab_size: int, *, add_prefix_space: bool = False,
                   special_tokens: Sequence[str] = ()) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``corpus``: every byte is in
    its alphabet, so any text encodes; ``add_prefix_space`` makes a leading word encode as
    it does after a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok
