"""The data pipeline: corpora, tokenizer, resumable rank-aware batches, downloads, errors.

Every cache goes to a temporary TITANLITE_DATA_DIR, so these tests neither read nor write
the repository's data/ folder, and nothing touches the network.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from titanlite.data import (
    DataBundle,
    StatefulBatchSampler,
    TokenBatches,
    build_data,
    corpus,
    corpus_id,
    default_data_dir,
    get_tokenizer,
    load_corpus,
    pydoc_corpus,
    split_train_val,
)
from titanlite.data import tokenizer as tokenizer_module
from titanlite.data.tokenizer import EOS, tokenizer_hash, train_bpe, wrap
from titanlite.errors import TitanliteError
from titanlite.tools.formats import corpora as remote

TRICKY_TEXT = "héllo wörld 🚀\r\n\tdef f(x):\n    return 4242  # ok  \n\n<b>tag</b> 'quoted'"


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    monkeypatch.setenv("TITANLITE_DATA_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def topics():
    """The help() topics alone: real text, and fast to train on."""
    return pydoc_corpus(include_stdlib=False)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    """One data dir for the tests that build the full pydoc corpus, so it is built once."""
    return tmp_path_factory.mktemp("shared-data")


def small_text_folder(root, n_docs=40):
    folder = root / "texts"
    folder.mkdir()
    for i in range(n_docs):
        lines = [f"Document {i} line {j}: the quick brown fox {i * j} jumps." for j in range(30)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines), encoding="utf-8")
    return folder


def one_line_error(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# --- corpora -----------------------------------------------------------------------------


def test_pydoc_corpus_is_real_deterministic_and_cached(shared_dir):
    first = pydoc_corpus(data_dir=shared_dir)  # parses the stdlib and caches the pages
    second = pydoc_corpus(data_dir=shared_dir)  # reads the cache
    assert first == second
    rendered = [corpus._render_module(m, f) for m, f in corpus._stdlib_sources()[:12]]
    fresh = [page for page in rendered if page]
    assert first[79 : 79 + len(fresh)] == fresh  # the cache holds exactly what parsing gives
    assert first[:79] == pydoc_corpus(include_stdlib=False)
    assert len(first) > 200 and sum(map(len, first)) > 1_000_000
    assert first[0].startswith("assert\n") and "assert_stmt" in first[0]
    assert any(doc.startswith("Module json\n") for doc in first)
    assert corpus_id("pydoc", first) == corpus_id("pydoc", second)


def test_file_corpus_reads_files_and_folders_in_sorted_order(tmp_path):
    folder = small_text_folder(tmp_path, n_docs=3)
    (folder / "notes.md").write_text("# Notes\r\nmarkdown counts too\r\n", encoding="utf-8")
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    docs = load_corpus(f"file:{folder}")
    assert len(docs) == 4 and docs[0].startswith("Document 0") and docs[3].startswith("# Notes\n")
    assert load_corpus(str(folder / "doc01.txt")) == [docs[1]]
    assert load_corpus("file", path=str(folder), max_docs=2) == docs[:2]
    assert sum(map(len, load_corpus(str(folder), max_chars=100))) == 100


def test_limits_and_corpus_id_track_the_content(topics):
    assert corpus_id("pydoc", topics) != corpus_id("pydoc", topics[:-1])
    assert corpus_id("pydoc", topics[:3]) == corpus_id("pydoc", list(topics[:3]))


# --- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_round_trips_and_loads_from_cache(topics, data_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = get_tokenizer(documents=topics, corpus_id="topics-test", vocab_size=512)
    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == 512
    assert tok.decode(tok.encode(TRICKY_TEXT)) == TRICKY_TEXT  # byte-level: lossless
    assert tok.convert_tokens_to_ids(EOS) == tok.eos_token_id == 1
    assert tok.encode(topics[5][:2000]) != list(topics[5][:2000].encode())  # merges happened

    (json_file,) = (data_dir / "cache" / "tokenizers").glob("topics-test-bpe512-*/tokenizer.json")
    folder = json_file.parent
    reloaded = AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(reloaded, PreTrainedTokenizerFast)
    assert reloaded.encode(TRICKY_TEXT) == tok.encode(TRICKY_TEXT)
    assert reloaded.eos_token == EOS and reloaded.bos_token == "<|bos|>"
    # A user-supplied tokenizer: the folder, or its tokenizer.json.
    for path in (folder, folder / "tokenizer.json"):
        assert get_tokenizer(str(path)).encode(TRICKY_TEXT) == tok.encode(TRICKY_TEXT)


def test_tokenizer_training_is_deterministic(topics):
    docs = topics[:30]
    assert train_bpe(docs, 400).to_str() == train_bpe(docs, 400).to_str()
    assert tokenizer_hash(wrap(train_bpe(docs, 400))) != tokenizer_hash(wrap(train_bpe(docs, 420)))


def test_parallel_ranks_train_the_tokenizer_once(topics, monkeypatch):
    calls = []
    real_train = tokenizer_module.train_bpe

    def counting_train(docs, vocab_size):
        calls.append(vocab_size)
        return real_train(docs, vocab_size)

    monkeypatch.setattr(tokenizer_module, "train_bpe", counting_train)
    results = [None] * 3

    def rank(i):
        results[i] = get_tokenizer(documents=topics[:40], corpus_id="race", vocab_size=400)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [400]  # the lock let one train; the others loaded its result
    assert len({r.backend_tokenizer.to_str() for r in results}) == 1


# --- sampler -----------------------------------------------------------------------------


def draw(sampler, steps):
    return [sampler.next_indices() for _ in range(steps)]


def test_sampler_is_deterministic_and_each_epoch_is_a_permutation():
    a, b = StatefulBatchSampler(20, 4, seed=7), StatefulBatchSampler(20, 4, seed=7)
    assert draw(a, 12) == draw(b, 12)
    c = StatefulBatchSampler(20, 4, seed=8)
    epoch0 = sum(draw(c, 5), [])
    assert sorted(epoch0) == list(range(20)) and epoch0 != list(range(20))
    assert sum(draw(c, 5), []) != epoch0  # epoch 1 is reshuffled
    assert sum(draw(StatefulBatchSampler(20, 4, seed=7), 5), []) != epoch0  # seed matters


def test_ranks_see_disjoint_windows_whose_union_is_the_single_rank_batch():
    single = draw(StatefulBatchSampler(50, 6, seed=3), 20)  # wraps past epochs too
    r0 = draw(StatefulBatchSampler(50, 3, rank=0, world_size=2, seed=3), 20)
    r1 = draw(StatefulBatchSampler(50, 3, rank=1, world_size=2, seed=3), 20)
    for step in range(20):
        assert r0[step] + r1[step] == single[step]
        assert not set(r0[step]) & set(r1[step])


def test_epoch_wrap_around_starts_a_fresh_shuffle():
    sampler = StatefulBatchSampler(7, 3, seed=1)  # 7 windows, 3 per step: 2 steps per epoch
    stream = sum(draw(sampler, 6), [])  # 3 epochs
    expected = torch.cat([sampler.order(e)[:6] for e in range(3)]).tolist()
    assert stream == expected  # each epoch's leftover window sits that epoch out
    assert all(len(set(stream[i : i + 6])) == 6 for i in (0, 6, 12))
    assert len({tuple(sampler.order(e).tolist()) for e in range(3)}) == 3
    assert (sampler.epoch, sampler.position, sampler.steps) == (3, 0, 6)
    tiny = StatefulBatchSampler(2, 5)  # fewer windows than one step: each step repeats them
    assert all(sorted(set(batch)) == [0, 1] for batch in draw(tiny, 3))


def token_batches(**kwargs):
    tokens = torch.arange(1000) % 97
    return TokenBatches(tokens, seq_len=9, batch_size=4, **kwargs)  # 100 windows of 10


def test_batches_are_shifted_windows():
    batches = token_batches(seed=5)
    x, y = batches.next_batch()
    assert x.shape == y.shape == (4, 9) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], (x[:, -1] + 1) % 97)  # y really continues x's window


@pytest.mark.parametrize("k", [3, 24, 60])  # mid-epoch, just before and after wrapping
def test_resume_reproduces_an_uninterrupted_run_exactly(k, tmp_path):
    uninterrupted = token_batches(seed=11)
    reference = [uninterrupted.next_batch() for _ in range(k + 10)]

    interrupted = token_batches(seed=11)
    for _ in range(k):
        interrupted.next_batch()
    torch.save(interrupted.state_dict(), tmp_path / "state.pt")  # as a checkpoint would
    resumed = token_batches(seed=11)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt"))
    for x_ref, y_ref in reference[k:]:
        x, y = resumed.next_batch()
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_resume_with_fewer_ranks_keeping_the_global_batch():
    two = [StatefulBatchSampler(30, 2, rank=r, world_size=2, seed=4) for r in range(2)]
    for sampler in two:
        draw(sampler, 9)
    state = two[1].state_dict()
    after = [sampler.next_indices() for sampler in two]
    one = StatefulBatchSampler(30, 4, seed=4)
    one.load_state_dict(state)  # any rank's state resumes any rank
    assert one.next_indices() == after[0] + after[1]


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(seed=99), "seed=0"),
        (dict(num_windows=31), "30 windows"),
        (dict(batch_size=3), "global batch"),
    ],
)
def test_incompatible_state_is_refused(change, needle):
    state = StatefulBatchSampler(30, 2, world_size=2).state_dict()
    settings = dict(num_windows=30, batch_size=2, world_size=2, seed=0) | change
    with pytest.raises(TitanliteError) as excinfo:
        StatefulBatchSampler(**settings).load_state_dict(state)
    one_line_error(excinfo, needle)
    with pytest.raises(TitanliteError) as excinfo:
        token_batches().load_state_dict({"epoch": 1})
    one_line_error(excinfo, "state_dict()")


def test_eval_batches_are_fixed_and_leave_training_alone():
    batches = token_batches(seed=1)
    first = batches.eval_batches(3)
    state = batches.state_dict()
    for _ in range(30):
        batches.next_batch()
    again = batches.eval_batches(3)
    other_seed = token_batches(seed=2).eval_batches(3)
    for (x1, y1), (x2, y2), (x3, _) in zip(first, again, other_seed):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(x1, x3)
    assert state["position"] == 0 and len({tuple(x[:, 0].tolist()) for x, _ in first}) == 3
    ranks = [token_batches(rank=r, world_size=2).eval_batches(2) for r in range(2)]
    single = TokenBatches(torch.arange(1000) % 97, 9, 8).eval_batches(2)
    for step in range(2):
        assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), single[step][0])


# --- build_data --------------------------------------------------------------------------


def test_build_data_end_to_end_and_cached(tmp_path, data_dir):
    folder = small_text_folder(tmp_path)
    bundle = build_data(f"file:{folder}", vocab_size=300, seq_len=16, batch_size=4, seed=3)
    assert isinstance(bundle, DataBundle) and bundle.vocab_size == len(bundle.tokenizer)
    assert bundle.split_by == "documents" and bundle.n_val_tokens > 0
    assert 0.03 < bundle.n_val_tokens / (bundle.n_train_tokens + bundle.n_val_tokens) < 0.08
    x, y = bundle.train.next_batch()
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < bundle.vocab_size
    stream = bundle.tokenizer.decode(bundle.train.windows[0].tolist())
    assert stream.startswith("Document 0 line 0")  # training starts at the first document
    (cache,) = (data_dir / "cache" / "tokens").glob(f"{bundle.corpus_id}-*.npz")

    again = build_data(f"file:{folder}", vocab_size=300, seq_len=16, batch_size=4, seed=3)
    assert torch.equal(again.train.next_batch()[0], x)
    assert again.corpus_id == bundle.corpus_id
    (folder / "doc00.txt").write_text("changed text " * 50, encoding="utf-8")
    changed = build_data(f"file:{folder}", vocab_size=300, seq_len=16, batch_size=4)
    assert changed.corpus_id != bundle.corpus_id  # new content -> new cache entries
    assert len(list((data_dir / "cache" / "tokens").glob("*.npz"))) == 2


def test_default_pydoc_bundle(shared_dir):
    bundle = build_data(data_dir=str(shared_dir), vocab_size=1024, seq_len=64, batch_size=2)
    assert bundle.corpus_id.startswith("pydoc-") and bundle.split_by == "documents"
    assert bundle.n_train_tokens > 10 * bundle.n_val_tokens > 0
    assert len(bundle.val.eval_batches(2)) == 2


def test_split_falls_back_to_the_tail_for_a_single_document():
    tokens = torch.arange(1000).numpy()
    train, val, how = split_train_val(tokens, torch.tensor([1000]).numpy(), 0.1, min_tokens=11)
    assert how == "tokens" and val.tolist() == list(range(900, 1000)) and len(train) == 900
    train, val, how = split_train_val(tokens, torch.tensor([1000]).numpy(), 0.01, min_tokens=65)
    assert len(val) == 65  # never smaller than one window


# --- downloads and Hugging Face datasets -------------------------------------------------


def test_tinyshakespeare_download_checks_the_checksum(tmp_path, data_dir):
    source = tmp_path / "input.txt"
    source.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    good = hashlib.sha256(source.read_bytes()).hexdigest()
    downloads = data_dir / "cache" / "downloads"

    with pytest.raises(TitanliteError) as excinfo:
        remote.tinyshakespeare(url=source.as_uri(), sha256="0" * 64)
    one_line_error(excinfo, "checksum mismatch", "discarded")
    assert [p.name for p in downloads.iterdir() if not p.name.endswith(".lock")] == []

    docs = remote.tinyshakespeare(url=source.as_uri(), sha256=good)
    assert docs == [source.read_text()]
    source.unlink()  # now served from the verified copy, no "network" needed
    assert remote.tinyshakespeare(url=source.as_uri(), sha256=good) == docs
    with pytest.raises(TitanliteError) as excinfo:
        remote.tinyshakespeare(url=source.as_uri(), sha256="1" * 64)
    one_line_error(excinfo, "could not download", "file:<path")


def test_hf_loader_reads_local_files(tmp_path):
    pytest.importorskip("datasets", reason="`datasets` is not installed (pip install datasets)")
    text = tmp_path / "lines.txt"
    text.write_text("first line\nsecond line\n\nthird line\n", encoding="utf-8")
    with pytest.raises(TitanliteError) as excinfo:  # the core never touches the network
        load_corpus(f"hf:{text}")
    one_line_error(excinfo, "fetched once before training", "titanlite.tools.formats.corpora.fetch")
    remote.fetch(f"hf:{text}")
    assert load_corpus(f"hf:{text}") == ["first line", "second line", "third line"]
    remote.fetch("hf", path=str(text), max_docs=2)
    assert load_corpus("hf", path=str(text), max_docs=2) == ["first line", "second line"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "content": "alpha beta"}\n{"id": 2, "content": "gamma"}\n')
    remote.fetch(f"hf:{rows}")
    assert load_corpus(f"hf:{rows}") == ["alpha beta", "gamma"]  # first string column
    with pytest.raises(TitanliteError) as excinfo:
        remote.fetch(f"hf:{rows}", text_column="contnet")
    one_line_error(excinfo, "no column 'contnet'", "did you mean: content")


def test_a_fetched_tinyshakespeare_trains_offline(tmp_path, data_dir, monkeypatch):
    source = tmp_path / "input.txt"
    source.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    monkeypatch.setattr(remote, "TINYSHAKESPEARE_URL", source.as_uri())
    monkeypatch.setattr(
        remote, "TINYSHAKESPEARE_SHA256", hashlib.sha256(source.read_bytes()).hexdigest()
    )
    monkeypatch.setattr(
        remote.tinyshakespeare,
        "__defaults__",
        (None, source.as_uri(), remote.TINYSHAKESPEARE_SHA256),
    )
    with pytest.raises(TitanliteError) as excinfo:
        load_corpus("tinyshakespeare", data_dir=data_dir)
    one_line_error(
        excinfo, "'tinyshakespeare' is fetched once before training", "`titanlite train`"
    )
    remote.fetch("tinyshakespeare", data_dir=data_dir)
    source.unlink()  # no "network" from here on
    assert load_corpus("tinyshakespeare", data_dir=data_dir) == [
        "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40
    ]


def test_hf_loader_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import fails
    with pytest.raises(TitanliteError) as excinfo:
        remote.fetch("hf:roneneldan/TinyStories")
    one_line_error(excinfo, "pip install datasets")


# --- errors and settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(dataset="pydocs"), ["unknown dataset 'pydocs'", "did you mean: pydoc"]),
        (dict(dataset="file:/no/such/corpus.txt"), ["does not exist", "/no/such/corpus.txt"]),
        (dict(dataset="missing.txt"), ["does not exist"]),
        (dict(batch_size=0), ["batch_size must be a positive integer"]),
        (dict(seq_len=-1), ["seq_len must be a positive integer"]),
        (dict(rank=2, world_size=2), ["rank must be an integer in [0, world_size=2)"]),
        (dict(world_size=0), ["world_size must be a positive integer"]),
        (dict(val_fraction=0.0), ["val_fraction must be in (0, 0.5]"]),
        (dict(tokenizer="/no/such/tokenizer"), ["no tokenizer at /no/such/tokenizer"]),
        (dict(vocab_size=100), ["vocab_size must be an integer >= 259"]),
        (
            dict(dataset="pydoc", path="x.txt"),
            ["--data.path is not used by --data.dataset pydoc", "--data.dataset file"],
        ),
    ],
)
def test_bad_settings_give_one_clear_line(kwargs, needles, tmp_path):
    if "tokenizer" in kwargs or "vocab_size" in kwargs:
        kwargs = dict(kwargs, dataset=f"file:{small_text_folder(tmp_path, 2)}")
    with pytest.raises(TitanliteError) as excinfo:
        build_data(**kwargs)
    one_line_error(excinfo, *needles)


def test_unreadable_and_too_small_corpora(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café crème".encode("latin-1"))
    with pytest.raises(TitanliteError) as excinfo:
        load_corpus(str(latin1))
    one_line_error(excinfo, "not UTF-8")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TitanliteError) as excinfo:
        load_corpus(f"file:{tmp_path / 'empty'}")
    one_line_error(excinfo, "no .txt or .md files")

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a short text of a few words, repeated. " * 20)
    with pytest.raises(TitanliteError) as excinfo:
        build_data(str(tiny), vocab_size=300, seq_len=4096)
    message = one_line_error(excinfo, "too few for seq_len=4096", "use seq_len <=")
    fits = int(message.split("use seq_len <= ")[1].split(",")[0])
    bundle = build_data(str(tiny), vocab_size=300, seq_len=fits, batch_size=2)
    assert bundle.split_by == "tokens" and bundle.val.num_windows >= 1


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TITANLITE_DATA_DIR", str(tmp_path / "x"))
    assert default_data_dir() == tmp_path / "x"
    monkeypatch.delenv("TITANLITE_DATA_DIR")
    assert default_data_dir().name == "data"
