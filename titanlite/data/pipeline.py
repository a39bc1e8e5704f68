"""`build_data`: corpus -> tokenizer -> token stream -> train/val split -> batches, cached by content hash.

Validation holds out whole *documents*, spread evenly: none neighbours a training window, and they cover
the same kinds of text. Too few documents (TinyShakespeare): the last val_fraction of tokens, as nanoGPT."""

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from ..errors import TitanliteError
from ._cache import atomic_file, build_lock, cache_subdir
from .corpus import corpus_id, load_corpus, parse_dataset
from .sampler import TokenBatches, _positive_int, check_rank
from .tokenizer import encode_documents, get_tokenizer, tokenizer_hash


@dataclass
class DataBundle:
    """Everything a training loop needs from the data side."""

    tokenizer: PreTrainedTokenizerFast
    vocab_size: int  # len(tokenizer): the embedding table needs a row for every id
    train: TokenBatches  # random windows, resumable via state_dict()
    val: TokenBatches  # use val.eval_batches(n): the same batches every time
    corpus_id: str
    n_train_tokens: int
    n_val_tokens: int
    eos_token_id: int  # separates documents; also a good prompt to generate "from scratch"
    split_by: str  # "documents" or "tokens" (see the module docstring)

    def __repr__(self) -> str:
        return (
            f"DataBundle({self.corpus_id}: vocab {self.vocab_size}, train {self.n_train_tokens:,} tokens"
            f" / {self.train.num_windows:,} windows, val {self.n_val_tokens:,} tokens / "
            f"{self.val.num_windows:,} windows, split by {self.split_by})"
        )


def build_data(
    dataset: str = "pydoc",
    path: str | None = None,
    tokenizer: str | None = None,
    vocab_size: int = 4096,
    seq_len: int = 128,
    batch_size: int = 8,
    val_fraction: float = 0.05,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    data_dir: str | None = None,
    max_chars: int | None = None,
    *,
    max_docs: int | None = None,
    hf_split: str = "train",
    text_column: str | None = None,
    verbose: bool = False,
    document_mask: bool = False,
) -> DataBundle:
    """Load, tokenize, split, batch. tokenizer: a folder or .json, or None: train (or reuse) a BPE one.
    document_mask: each batch also says which document each token is in (sampler.TokenBatches)."""
    # cheap checks first: a typo fails in ms, not after tokenizing
    _positive_int("seq_len", seq_len, 128)
    _positive_int("batch_size", batch_size)
    check_rank(rank, world_size)
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, (int, float))
        or not 0 < val_fraction <= 0.5
    ):
        raise TitanliteError(
            f"val_fraction must be in (0, 0.5], got {val_fraction!r}; "
            "0.05 holds out 5% of the corpus for validation"
        )
    kind, target = parse_dataset(dataset, path)
    docs = load_corpus(
        dataset,
        path,
        data_dir=data_dir,
        max_chars=max_chars,
        max_docs=max_docs,
        hf_split=hf_split,
        text_column=text_column,
    )
    cid = corpus_id(kind if target is None else f"{kind}-{Path(target).name or target}", docs)
    tok = get_tokenizer(
        tokenizer,
        documents=docs,
        corpus_id=cid,
        vocab_size=vocab_size,
        data_dir=data_dir,
        verbose=verbose,
    )
    tokens, doc_lengths = cached_token_stream(tok, docs, cid, data_dir)
    train_tokens, val_tokens, split_by = split_train_val(
        tokens, doc_lengths, val_fraction, seq_len + 1
    )
    if min(len(train_tokens), len(val_tokens)) < seq_len + 1:
        fit = len(tokens) // 2 - 1
        more = f"raise max_chars={max_chars}" if max_chars else "use more text"
        hint = f"use seq_len <= {fit}, or {more}" if fit >= 1 else more
        raise TitanliteError(
            f"corpus {cid} has only {len(tokens):,} tokens, too few for seq_len={seq_len} "
            f"(train and validation each need at least seq_len+1 = {seq_len + 1}); {hint}"
        )
    train, val = (
        TokenBatches(
            torch.from_numpy(part.astype(np.int32)),
            seq_len,
            batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
            eos_id=tok.eos_token_id if document_mask else None,
        )
        for part in (train_tokens, val_tokens)
    )
    return DataBundle(
        tokenizer=tok,
        vocab_size=len(tok),
        train=train,
        val=val,
        corpus_id=cid,
        n_train_tokens=len(train_tokens),
        n_val_tokens=len(val_tokens),
        eos_token_id=tok.eos_token_id,
        split_by=split_by,
    )


def data_for(cfg, tokenizer: str | None, micro_batch: int, dims, rank: int):
    """`build_data` as a run's [data] and [training] sections ask, with the micro-batch preflight
    resolved and this rank's place among the data-parallel ranks (`dims`, a ParallelDims): it
    reads its own slice of every global batch, and under context parallelism keeps only its part
    of every sequence (`dims.sequence_part`), in both splits."""
    data, training = cfg.data, cfg.training
    bundle = build_data(
        data.dataset,
        path=data.path,
        tokenizer=tokenizer,
        seed=training.seed,
        vocab_size=data.vocab_size,
        seq_len=training.seq_len,
        batch_size=micro_batch,
        val_fraction=data.val_fraction,
        data_dir=data.data_dir,
        max_chars=data.max_chars,
        rank=dims.dp_rank(rank),
        world_size=dims.data_slices,
        document_mask=data.document_mask,
    )
    sequence_part = dims.sequence_part(rank, cfg.parallel.cp_layout)
    bundle.train.part = bundle.val.part = sequence_part
    return bundle


def cached_token_stream(
    tok: PreTrainedTokenizerFast, docs: list[str], cid: str, data_dir=None
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, doc_lengths) for the corpus, from cache/tokens/ or encoded and saved there."""
    file = cache_subdir(data_dir, "tokens") / f"{cid}-{tokenizer_hash(tok)}.npz"
    if (cached := _read_stream(file)) is not None:  # built already: no lock needed
        return cached
    with build_lock(file):  # one rank encodes, the others wait and then read its file
        if (cached := _read_stream(file)) is not None:  # another rank wrote it while we waited
            return cached
        tokens, doc_lengths = encode_documents(tok, docs)
        with atomic_file(file) as tmp:  # tmp has the file's name: numpy appends no second ".npz"
            np.savez(tmp, tokens=tokens, doc_lengths=doc_lengths)
    return tokens, doc_lengths


def _read_stream(file: Path) -> tuple[np.ndarray, np.ndarray] | None:
    try:  # a missing file is an OSError too
        with np.load(file) as saved:
            return saved["tokens"], saved["doc_lengths"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None  # unreadable cache (e.g. a disk filled up): rebuild it


def split_train_val(
    tokens: np.ndarray, doc_lengths: np.ndarray, val_fraction: float, min_tokens: int
) -> tuple[np.ndarray, np.ndarray, str]:
    """(train tokens, val tokens, "documents" | "tokens"); see the module docstring."""
    is_val = np.zeros(len(doc_lengths), dtype=bool)
    val_total = seen = 0
    for i, n in enumerate(doc_lengths.tolist()):
        seen += n
        # taking it moves the val share closer to its target
        if val_total + n / 2 < val_fraction * seen:
            is_val[i] = True
            val_total += n
    if min_tokens <= val_total <= len(tokens) - min_tokens:
        owner = np.repeat(is_val, doc_lengths)  # per token: does its document go to val?
        return tokens[~owner], tokens[owner], "documents"
    n_val = min(max(math.ceil(val_fraction * len(tokens)), min_tokens), len(tokens))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :], "tokens"
