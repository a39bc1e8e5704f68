"""A byte-level BPE tokenizer in the style of Llama 3, trained on our corpus in seconds.

The base vocabulary is the 256 bytes: any text encodes (no unknown token) and decodes back exactly.
Llama 3's split keeps words, numbers (<= 3 digits), punctuation and whitespace apart: no merge spans two."""

import time
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.pre_tokenizers import ByteLevel, Split
from transformers import PreTrainedTokenizerFast

from ..errors import TitanliteError
from ._cache import atomic_file, build_lock, cache_subdir, fingerprint

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
RECIPE = "bytelevel-bpe-llama3split-v1"  # bump when the training recipe changes


def train_bpe(documents: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer. Deterministic: same documents, same tokenizer."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tok


def check_vocab_size(vocab_size) -> None:
    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int)
        or vocab_size < MIN_VOCAB_SIZE
    ):
        raise TitanliteError(
            f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}; try 4096"
        )


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view of a `tokenizers.Tokenizer`, with our special tokens named."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def get_tokenizer(
    path: str | None = None,
    *,
    documents: list[str] | None = None,
    corpus_id: str | None = None,
    vocab_size: int = 4096,
    data_dir=None,
    verbose: bool = False,
) -> PreTrainedTokenizerFast:
    """The tokenizer at `path` (folder or .json), or one of `vocab_size` trained on `documents` and cached."""
    if path is not None:
        return load_tokenizer(path)
    if documents is None:
        raise TitanliteError(
            "get_tokenizer needs either path= (an existing tokenizer) or "
            "documents= (text to train one on); pass one of them"
        )
    check_vocab_size(vocab_size)
    corpus_id = corpus_id or f"corpus-{fingerprint(*documents)}"
    folder = (
        cache_subdir(data_dir, "tokenizers")
        / f"{corpus_id}-bpe{vocab_size}-{fingerprint(RECIPE)[:6]}"
    )
    if not (folder / "tokenizer.json").is_file():
        with build_lock(folder):  # one rank trains, the others wait and then load
            if not (folder / "tokenizer.json").is_file():
                start = time.perf_counter()
                with atomic_file(folder, is_dir=True) as tmp:
                    wrap(train_bpe(documents, vocab_size)).save_pretrained(str(tmp))
                if verbose:
                    print(
                        f"trained a {vocab_size}-token BPE tokenizer in "
                        f"{time.perf_counter() - start:.1f}s -> {folder}"
                    )
    return load_tokenizer(folder)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """A folder saved by `save_pretrained`, or a bare tokenizer.json file."""
    path = Path(path).expanduser()
    try:
        if path.is_file():
            tok = wrap(Tokenizer.from_file(str(path)))
        # a checkpoint's own folder (e.g. Llama 3's): never downloaded
        elif (path / "tokenizer.json").is_file():
            tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            raise TitanliteError(
                f"no tokenizer at {path} (expected a tokenizer.json file or a folder "
                "containing one); check the path, or pass tokenizer=None to train one "
                "on the corpus"
            )
    except TitanliteError:
        raise
    except Exception as err:
        raise TitanliteError(
            f"cannot load the tokenizer at {path} ({str(err)[:200]}); "
            "point to a valid Hugging Face tokenizer.json"
        ) from None
    # documents are separated by eos in the token stream: one must exist
    if tok.eos_token_id is None:
        if EOS not in tok.get_vocab():
            raise TitanliteError(
                f"the tokenizer at {path} has no eos token; set "
                '"eos_token" in its tokenizer_config.json'
            )
        tok.eos_token = EOS
    return tok


def tokenizer_hash(tok: PreTrainedTokenizerFast) -> str:
    """Changes whenever the vocabulary, merges or special tokens change."""
    return fingerprint(tok.backend_tokenizer.to_str(), str(tok.eos_token_id))


def encode_documents(
    tok: PreTrainedTokenizerFast, documents: list[str], chunk: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """(token stream, per-document lengths): every document's tokens followed by eos."""
    eos, encode = tok.eos_token_id, tok.backend_tokenizer.encode_batch_fast
    pieces = [
        np.asarray(enc.ids + [eos], dtype=np.int64)
        for start in range(0, len(documents), chunk)  # chunks bound the memory of Encodings
        for enc in encode(documents[start : start + chunk], add_special_tokens=False)
    ]
    dtype = np.uint16 if len(tok) <= np.iinfo(np.uint16).max + 1 else np.int32
    tokens = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
    return tokens, np.asarray([len(p) for p in pieces], dtype=np.int64)
