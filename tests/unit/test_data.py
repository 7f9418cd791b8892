"""Built-in data needs no download; shards are deterministic and disjoint."""

import numpy as np
import pytest

from swarm.training.data import DataConfig, ShardSampler, load_dataset, val_indices

GPT = {"kind": "gpt", "seq_len": 32, "vocab_size": 256}


def test_stdlib_corpus_is_deterministic_and_split():
    cfg = DataConfig(max_bytes=400_000)
    a, b = load_dataset(cfg, GPT), load_dataset(cfg, GPT)
    assert a.num_train > 1000 and a.num_val > 10
    xa, ya = a.train([0, 7, 99])
    xb, _ = b.train([0, 7, 99])
    assert (xa == xb).all() and xa.shape == (3, 32)
    assert (xa[:, 1:] == ya[:, :-1]).all()  # targets are inputs shifted by one
    assert int(xa.max()) < 256
    assert not np.array_equal(a._train[:1000], a._val[:1000])


def test_shards_are_disjoint_and_cover_the_epoch():
    shards = [ShardSampler(1000, j, 3, seed=5).epoch(0) for j in range(3)]
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 1000
    assert ShardSampler(1000, 1, 3, seed=5).epoch(0) == shards[1]
    assert ShardSampler(1000, 1, 3, seed=5).epoch(1) != shards[1]


def test_text_folder_and_token_file(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(30):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * 200)
    ds = load_dataset(DataConfig(kind="text", path=str(folder)), GPT)
    assert ds.num_train > 10
    tokens = np.arange(5000, dtype=np.uint16) % 1000
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    ds = load_dataset(DataConfig(kind="tokens", path=str(path)), {**GPT, "vocab_size": 1000})
    x, y = ds.train([2])
    assert x[0, 0].item() == 64 and y[0, 0].item() == 65
    with pytest.raises(ValueError, match="vocabulary"):
        load_dataset(DataConfig(kind="tokens", path=str(path)), {**GPT, "vocab_size": 500})


def test_bad_data_configs(tmp_path):
    with pytest.raises(ValueError, match="needs --data-path"):
        DataConfig(kind="tokens")
    with pytest.raises(ValueError, match="unknown dataset"):
        DataConfig(kind="imagenet")
    with pytest.raises(ValueError, match="not a folder"):
        load_dataset(DataConfig(kind="text", path=str(tmp_path / "missing")), GPT)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_dataset(DataConfig(kind="text", path=str(tmp_path / "empty")), GPT)


def test_synthetic_and_val_indices():
    ds = load_dataset(DataConfig(kind="synthetic", synthetic_samples=500), {"kind": "mlp", "in_dim": 8, "n_classes": 4})
    x, y = ds.train([1, 2])
    x2, _ = ds.train([1, 2])
    assert (x == x2).all() and x.shape == (2, 8) and int(y.max()) < 4
    idx = val_indices(ds, 10)
    assert len(idx) == 10 and len(set(idx)) == 10
