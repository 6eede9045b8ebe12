"""A training run that can save and resume itself part-way through state_dict() (model, optimizer
and a LambdaLR schedule, through torch.save into memory and back into fresh objects)."""
import io

import torch

import zenflow

KW = dict(lr=2e-3, topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=4)


def run(make, loss_fn, opt_kwargs, steps, resume_at=None):
    model = make()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **opt_kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + 0.1 * t))
    for t in range(steps):
        if t == resume_at:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buffer)
            opt.close()
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            model = make()
            model.load_state_dict(saved["model"])
            opt = zenflow.ZenFlowAdamW(model.parameters(), **opt_kwargs)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + 0.1 * t))
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()
        sched.step()
    stats = opt.stats()
    opt.close()
    return model, stats


_UNINTERRUPTED: dict = {}


def run_once(make, loss_fn, opt_kwargs, steps):
    """run() without a resume, computed once per (model, settings, steps) in this process: the
    uninterrupted run that the cases resuming at different steps all compare against (they only
    read its weights and stats)."""
    key = (make, loss_fn, tuple(sorted(opt_kwargs.items())), steps)
    if key not in _UNINTERRUPTED:
        _UNINTERRUPTED[key] = run(make, loss_fn, opt_kwargs, steps)
    return _UNINTERRUPTED[key]
