"""The data pipeline: text in, reproducible (x, y) token batches out.

data = build_data("pydoc", seq_len=128, batch_size=8)  # offline, cached after the 1st call
x, y = data.train.next_batch()  # int64 [8, 128], y = x shifted by 1; resume via state_dict()"""

from ._cache import default_data_dir
from .corpus import corpus_id, load_corpus, pydoc_corpus
from .pipeline import DataBundle, build_data, data_for, split_train_val
from .sampler import StatefulBatchSampler, TokenBatches
from .tokenizer import get_tokenizer

__all__ = [
    "build_data",
    "data_for",
    "DataBundle",
    "TokenBatches",
    "StatefulBatchSampler",
    "load_corpus",
    "pydoc_corpus",
    "corpus_id",
    "get_tokenizer",
    "split_train_val",
    "default_data_dir",
]
