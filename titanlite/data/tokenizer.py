"""A byte-level BPE tokenizer in the style of Llama 3, trained on our corpus in seconds.

Byte-level means the base vocabulary is the 256 byte values, so any text (emoji, code,
any script) encodes without an unknown token and decodes back exactly. The pre-tokenizer
is Llama 3's split pattern: words, numbers in groups of at most 3 digits, punctuation runs
and whitespace are kept apart before BPE merges, so merges never glue "the" to ".".

Trained tokenizers are cached as an ordinary Hugging Face tokenizer folder
(`AutoTokenizer.from_pretrained(folder)` works on it) under <data_dir>/cache/tokenizers/.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ..errors import TitanliteError
from ._cache import atomic_dir, build_lock, cache_subdir, fingerprint

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RECIPE = "bytelevel-bpe-llama3split-v1"  # bump when the training recipe changes


def train_bpe(documents: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer. Deterministic: same documents, same tokenizer."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always
    )
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tok


def check_vocab_size(vocab_size) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or vocab_size < MIN_VOCAB_SIZE:
        raise TitanliteError(f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + "
                             f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}; "
                             "try 4096")


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view of a `tokenizers.Tokenizer`, with our special tokens named."""
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, clean_up_tokenization_spaces=False)


def get_tokenizer(path: str | None = None, *, documents: list[str] | None = None,
                  corpus_id: str | None = None, vocab_size: int = 4096,
                  data_dir=None, verbose: bool = False) -> PreTrainedTokenizerFast:
    """Load the tokenizer at `path` (a folder or a tokenizer.json), or train one of
    `vocab_size` on `documents` (cached by corpus_id, so later calls just load it)."""
    if path is not None:
        return load_tokenizer(path)
    if documents is None:
        raise TitanliteError("get_tokenizer needs either path= (an existing tokenizer) or "
                             "documents= (text to train one on); pass one of them")
    check_vocab_size(vocab_size)
    corpus_id = corpus_id or f"corpus-{fingerprint(*documents)}"
    name = f"{corpus_id}-bpe{vocab_size}-{fingerprint(RECIPE, length=6)}"
    folder = cache_subdir(data_dir, "tokenizers") / name
    if not (folder / "tokenizer.json").is_file():
        with build_lock(folder):  # one rank trains, the others wait and then load
            if not (folder / "tokenizer.json").is_file():
                start = time.perf_counter()
                hf_tok = wrap(train_bpe(documents, vocab_size))
                with atomic_dir(folder) as tmp:
                    hf_tok.save_pretrained(str(tmp))
                if verbose:
                    print(f"trained a {vocab_size}-token BPE tokenizer in "
                          f"{time.perf_counter() - start:.1f}s -> {folder}")
    return load_tokenizer(folder)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """A folder saved by `save_pretrained`, or a bare tokenizer.json file."""
    path = Path(path).expanduser()
    try:
        if path.is_file():
            tok = wrap(Tokenizer.from_file(str(path)))
        elif (path / "tokenizer.json").is_file():
            # A checkpoint's own tokenizer (e.g. Llama 3's 128K vocabulary), never downloaded.
            tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            raise TitanliteError(f"no tokenizer at {path} (expected a tokenizer.json file or a "
                                 "folder containing one); check the path, or pass "
                                 "tokenizer=None to train one on the corpus")
    except TitanliteError:
        raise
    except Exception as err:
        raise TitanliteError(f"cannot load the tokenizer at {path} ({str(err)[:200]}); "
                             "point to a valid Hugging Face tokenizer.json") from None
    if tok.eos_token_id is None:
        # Documents are separated by eos in the token stream, so one must exist.
        if EOS in tok.get_vocab():
            tok.eos_token = EOS
        else:
            raise TitanliteError(f"the tokenizer at {path} has no eos token; set "
                                 "\"eos_token\" in its tokenizer_config.json")
    return tok


def tokenizer_hash(tok: PreTrainedTokenizerFast) -> str:
    """Changes whenever the vocabulary, merges or special tokens change."""
    return fingerprint(tok.backend_tokenizer.to_str(), str(tok.eos_token_id))


def encode_documents(tok: PreTrainedTokenizerFast, documents: list[str],
                     chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(token stream, per-document lengths): every document's tokens followed by eos."""
    eos = tok.eos_token_id
    backend = tok.backend_tokenizer
    pieces, lengths = [], []
    for start in range(0, len(documents), chunk):  # chunks bound the memory of Encodings
        for enc in backend.encode_batch_fast(documents[start:start + chunk],
                                             add_special_tokens=False):
            ids = enc.ids + [eos]
            pieces.append(np.asarray(ids, dtype=np.int64))
            lengths.append(len(ids))
    dtype = np.uint16 if len(tok) <= np.iinfo(np.uint16).max + 1 else np.int32
    tokens = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
    return tokens, np.asarray(lengths, dtype=np.int64)
