"""The data pipeline: text in, reproducible (x, y) token batches out.

    from titanlite.data import build_data
    data = build_data("pydoc", seq_len=128, batch_size=8)   # offline, cached after the 1st call
    x, y = data.train.next_batch()                           # int64 [8, 128], y = x shifted by 1
    val = data.val.eval_batches(4)                           # the same 4 batches every call
    state = data.train.state_dict()                          # save with the model; resume with
    data.train.load_state_dict(state)                        # load_state_dict -> same batches

Modules: `corpus` (where text comes from), `remote` (downloads, Hugging Face datasets),
`tokenizer` (byte-level BPE), `sampler` (resumable rank-aware batches), `pipeline`
(`build_data`, caching and the train/val split).
"""
from ._cache import default_data_dir
from .corpus import corpus_id, load_corpus, pydoc_corpus
from .pipeline import DataBundle, build_data, split_train_val
from .sampler import StatefulBatchSampler, TokenBatches
from .tokenizer import SPECIAL_TOKENS, get_tokenizer, load_tokenizer, train_bpe

__all__ = [
    "build_data", "DataBundle", "TokenBatches", "StatefulBatchSampler", "load_corpus",
    "pydoc_corpus", "corpus_id", "get_tokenizer", "load_tokenizer", "train_bpe",
    "SPECIAL_TOKENS", "split_train_val", "default_data_dir",
]
